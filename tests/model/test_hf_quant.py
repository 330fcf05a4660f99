"""HF checkpoints with int8 / 4-bit linears (model_infer/hf_quant_reader.py), served packed: tiny random Llama and
Qwen3 checkpoints whose linear weights this test quantizes and writes in each format by its definition
(compressed-tensors int-quantized and pack-quantized, W8A16, W8A8 and W4A16; AWQ GEMM; GPTQ 4-bit symmetric and
asymmetric, with and without act-order, and 8-bit), with their config.json quantization_config. The reference is
transformers in float32 over the same weights dequantized here (scale * (q - zero)); greedy tokens must be its greedy
tokens by teacher forcing (tests/greedy_check.py). Also: bf16 activations, two ranks' shards, and the refusals (what a
quantization_config may say that is not served, act-order over two ranks, quantized weights off the CPU backend).
The test's packers agree with vLLM's gptq_pack / awq_pack and compressed-tensors' pack_to_int32."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightserve.config import Device, KernelBackend, ServerConfig
from lightserve.engine.procs import StartError
from lightserve.kernels.quant_linear import GGMLType, QuantLinear
from lightserve.model_infer.hf_quant_reader import HFQuantReader, QuantScheme
from lightserve.model_infer.models import check_tp, config_from_dict, read_model_config
from lightserve.resolve_config import resolve_config
from tests.greedy_check import greedy_mismatch

from .test_gguf_loading import PROMPTS, generate
from .tiny_models import load_model_dir, make_tiny_model

SIZES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}  # every K a multiple of 128; C attention
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 6
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i of a word holds column AWQ_ORDER[i] of its 8

# case: (tiny model, format, bits, group size (-1: per channel), symmetric, act-order, int8 activations)
CASES = {
    "ct_w8a16_channel": ("llama3", "int-quantized", 8, -1, True, False, False),
    "ct_w8a16_group128": ("qwen3", "int-quantized", 8, 128, True, False, False),
    "ct_w8a16_packed_group64": ("llama3", "pack-quantized", 8, 64, True, False, False),
    "ct_w8a8": ("qwen3", "int-quantized", 8, -1, True, False, True),
    "ct_w4a16_group32": ("llama3", "pack-quantized", 4, 32, True, False, False),
    "awq_g32": ("qwen3", "awq", 4, 32, False, False, False),
    "awq_g128": ("llama3", "awq", 4, 128, False, False, False),
    "gptq_g64_sym": ("llama3", "gptq", 4, 64, True, False, False),
    "gptq_g64_asym": ("qwen3", "gptq", 4, 64, False, False, False),
    "gptq_g64_sym_act_order": ("qwen3", "gptq", 4, 64, True, True, False),
    "gptq_g64_asym_act_order": ("llama3", "gptq", 4, 64, False, True, False),
    "gptq_8bit_g128": ("qwen3", "gptq", 8, 128, True, False, False),
}


def quantize(w: torch.Tensor, group: torch.Tensor, bits: int, symmetric: bool, gen: torch.Generator):
    """w [N, K] -> (q [N, K] int64: signed for 8 bits, unsigned for 4; scale [N, G] fp16; zero [N, G] int64), the
    columns of group j (group[k] == j) sharing scale[:, j] and zero[:, j]; the dequantized weight is
    scale * (q - zero)."""
    n, groups = w.shape[0], int(group.max()) + 1
    q, scale = torch.zeros_like(w, dtype=torch.int64), torch.zeros(n, groups, dtype=torch.float16)
    zero = torch.zeros(n, groups, dtype=torch.int64)
    for j in range(groups):
        cols = (group == j).nonzero().squeeze(1)
        part = w[:, cols]
        if bits == 8:  # symmetric int8
            s = (part.abs().amax(1) / 127).half().float().clamp_min(1e-4)
            q[:, cols] = (part / s[:, None]).round().clamp(-128, 127).long()
        elif symmetric:  # 4 bits about 8
            s = (part.abs().amax(1) / 7).half().float().clamp_min(1e-4)
            zero[:, j] = 8
            q[:, cols] = ((part / s[:, None]).round() + 8).clamp(0, 15).long()
        else:  # 4 bits, a zero of 1 .. 15 (GPTQ's v1 format cannot store 0) nudged at random
            lo, hi = part.amin(1).clamp_max(0), part.amax(1).clamp_min(0)
            s = ((hi - lo) / 15).half().float().clamp_min(1e-4)
            z = (-lo / s).round().clamp(1, 15).long() + torch.randint(-1, 2, (n,), generator=gen)
            zero[:, j] = z.clamp(1, 15)
            q[:, cols] = ((part / s[:, None]).round() + zero[:, j:j + 1]).clamp(0, 15).long()
        scale[:, j] = s.half()
    return q, scale, zero


def dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    return scale.float()[:, group] * (q - zero[:, group]).float()


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., W * 32 / bits] unsigned values -> [..., W] int32, value i of a word at bits * i."""
    per = 32 // bits
    v = values.long().reshape(*values.shape[:-1], -1, per)
    words = (v << (torch.arange(per) * bits)).sum(-1)
    return (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32)


def ct_config(fmt: str, bits: int, group_size: int, int8_acts: bool) -> dict:
    per_channel = group_size < 0
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
               "strategy": "channel" if per_channel else "group", "group_size": None if per_channel else group_size}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    acts = acts if int8_acts else None
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def write_case(case: str, base: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny checkpoint `base` with its linears quantized as `case` says, in `out`; and the dequantized weights."""
    kind, fmt, bits, group_size, symmetric, act_order, int8_acts = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    tensors, written, reference = load_file(base / "model.safetensors"), {}, {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) < 3 or module[1] not in LINEARS or module[2] != "weight":
            written[name] = w
            continue
        prefix = name[: -len(".weight")]
        n, k = w.shape
        group = torch.arange(k) // (k if group_size < 0 else group_size)
        if act_order:  # GPTQ's g_idx after a desc_act column order: group i // g of the i-th column in that order,
            # one order per input (GPTQ's order sorts the input's Hessian: q, k, v share theirs, gate and up theirs)
            order = torch.randperm(k, generator=torch.Generator().manual_seed(k + ("o_proj" in name)))
            group = torch.empty_like(group)
            group[order] = torch.arange(k) // group_size
        q, scale, zero = quantize(w, group, bits, symmetric, gen)
        reference[name] = dequantized(q, scale, zero, group)
        if fmt == "int-quantized":
            written[name], written[prefix + ".weight_scale"] = q.to(torch.int8), scale
        elif fmt == "pack-quantized":  # signed values stored + 2^(bits - 1)
            signed = q if bits == 8 else q - 8
            written[prefix + ".weight_packed"] = pack_words(signed + (1 << (bits - 1)), bits)
            written[prefix + ".weight_shape"] = torch.tensor([n, k])
            written[prefix + ".weight_scale"] = scale
        elif fmt == "awq":  # [K, N / 8] words of 8 output columns each, in AWQ's order
            interleave = torch.tensor(AWQ_ORDER)
            written[prefix + ".qweight"] = pack_words(q.T.reshape(k, -1, 8)[:, :, interleave].reshape(k, n), 4)
            written[prefix + ".qzeros"] = pack_words(zero.T.reshape(-1, n // 8, 8)[:, :, interleave].reshape(-1, n), 4)
            written[prefix + ".scales"] = scale.T.contiguous()
        else:  # GPTQ: qweight [K / per, N] (per input rows a word), qzeros [G, N / per] holding zero - 1 (format
            # "gptq"); 8 bits unsigned about 128
            per = 32 // bits
            u, z = (q + 128, zero + 128) if bits == 8 else (q, zero)
            written[prefix + ".qweight"] = pack_words(u.T.reshape(k // per, per, n).transpose(1, 2), bits)[..., 0]
            written[prefix + ".qzeros"] = pack_words((z - 1).T & ((1 << bits) - 1), bits).contiguous()
            written[prefix + ".scales"] = scale.T.contiguous()
            written[prefix + ".g_idx"] = group.to(torch.int32)
    out.mkdir()
    save_file({k: v.contiguous() for k, v in written.items()}, out / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    if fmt in ("int-quantized", "pack-quantized"):
        config["quantization_config"] = ct_config(fmt, bits, group_size, int8_acts)
    elif fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "desc_act": act_order, "sym": symmetric, "checkpoint_format": "gptq",
                                         "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
    (out / "config.json").write_text(json.dumps(config))
    return out, reference


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_quant_bases")
    return {kind: make_tiny_model(kind, root / kind, **SIZES) for kind in ("llama3", "qwen3")}


def reference_model(base: Path, weights: dict[str, torch.Tensor]):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(case, bases, tmp_path):
    kind, fmt, bits, _, _, act_order, int8_acts = CASES[case]
    folder, weights = write_case(case, bases[kind], tmp_path / case)
    config = read_model_config(folder)
    scheme = QuantScheme.from_json(config.quantization)
    assert (scheme.act_order, scheme.int8_activations) == (act_order, int8_acts)
    model = load_model_dir(folder, torch.float32)
    layer = model.weights.layers[0]
    want = GGMLType.Q8_0F if bits == 8 else GGMLType.Q4_1F
    for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert isinstance(w, QuantLinear) and [s.qtype for s in w.segments] == [want]
        assert (w.in_perm is not None) == act_order
    # the one-call driver takes the layers but for act-order ones (whose x is gathered first)
    assert (model.cpu_layers is None) == act_order
    hf = reference_model(bases[kind], weights)
    for prompt, got in zip(PROMPTS, generate(model, PROMPTS, NEW_TOKENS)):
        problem = greedy_mismatch(hf, prompt, got)
        assert problem is None, f"{case}: {problem}"


def test_bfloat16_activations_follow_float32(bases, tmp_path):
    """bf16 activations (the kernel widens x per call): logits within bf16 noise of the float32 model's."""
    from .fake_worker import FakeWorker

    folder, _ = write_case("gptq_g64_asym", bases["qwen3"], tmp_path / "q")
    expected = FakeWorker(load_model_dir(folder, torch.float32)).step(list(enumerate(PROMPTS)), num_decode=0)
    got = FakeWorker(load_model_dir(folder, torch.bfloat16)).step(list(enumerate(PROMPTS)), num_decode=0)
    torch.testing.assert_close(got, expected, atol=0.1 * float(expected.abs().max()), rtol=0.0)


def test_act_order_over_two_ranks_and_off_cpu_are_refused(bases, tmp_path):
    folder, _ = write_case("gptq_g64_sym_act_order", bases["qwen3"], tmp_path / "q")
    config = read_model_config(folder)
    check_tp(config, 1)
    with pytest.raises(ValueError, match="act-order weights .* one rank"):
        check_tp(config, 2)
    with pytest.raises(ValueError, match="CPU only"):
        HFQuantReader(folder, QuantScheme.from_json(config.quantization), torch.float32, "cuda")
    with pytest.raises(StartError, match="quantized weights are served packed on CPU only"):
        resolve_config(ServerConfig(model_dir=str(folder), device=Device.CPU, kernel_backend=KernelBackend.TRITON))


BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256}


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": True}, "gptq bits=3 is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method 'fp8' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "gptq group_size 16 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "gptq checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({**ct_config("float-quantized", 8, -1, False)}, "compressed-tensors format 'float-quantized'"),
    ({**ct_config("int-quantized", 8, -1, False), "quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ({**ct_config("pack-quantized", 8, -1, False), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": False, "strategy": "tensor"}}}},
     "input activations int8 tensor static are not supported"),
    ({**ct_config("int-quantized", 8, -1, False), "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}}}},
     "asymmetric weights are not supported"),
])
def test_unserved_quantization_is_refused_naming_it(quantization, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({**BASE, "quantization_config": quantization})


@pytest.mark.parametrize("case", ["gptq_g64_asym", "ct_w8a16_group128"])
def test_tensor_parallel_shards_are_slices_of_the_whole(case, bases, tmp_path):
    """Each of two ranks' packed weights dequantize to its rows (q | k | v, gate | up) or input columns (o_proj, down:
    whole blocks of a group) of the one-rank weights."""
    from lightserve.kernels.quant_linear import dequantize
    from lightserve.model_infer.models import load_weights

    kind = CASES[case][0]
    folder, _ = write_case(case, bases[kind], tmp_path / case)
    config = read_model_config(folder)
    check_tp(config, 2)
    whole = load_weights(folder, config, torch.float32).layers[0]
    hd, inter = config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    qkv = dequantize(whole.qkv_proj).split([q, kv, kv])
    gate, up = dequantize(whole.gate_up_proj).split([inter, inter])
    for rank in range(2):
        part = load_weights(folder, config, torch.float32, "cpu", rank, 2).layers[0]
        rows = [t.chunk(2)[rank] for t in (*qkv, gate, up)]
        assert torch.equal(dequantize(part.qkv_proj), torch.cat(rows[:3]))
        assert torch.equal(dequantize(part.gate_up_proj), torch.cat(rows[3:]))
        assert torch.equal(dequantize(part.o_proj), dequantize(whole.o_proj).chunk(2, dim=1)[rank])
        assert torch.equal(dequantize(part.down_proj), dequantize(whole.down_proj).chunk(2, dim=1)[rank])
