"""The CPU forward's one-call decoder layers (kernels/decoder_layers.py) against the same model run one kernel call
at a time: logits and every layer's KV cache bit for bit equal, over a ragged prefill, decode steps and a mixed
decode + extend batch with a prefix-cache hit, for the Llama-family variants the driver takes (biases, windows,
Qwen3's q/k norms, GQA groups of 1-3), in float32 and bf16: every step where this CPU's bf16 GEMMs all run in C,
the decode steps of up to PAIR_MAX_M tokens where larger ones run on oneDNN (and not the fresh prefills whose
attention torch's SDPA runs on AMX CPUs without the C kernel's tiles); the same with LoRA adapters on some requests
(float32 and bf16 stacks; float16 ones run kernel by kernel). Also which models it declines."""
from __future__ import annotations

import ctypes
import dataclasses
import sys

import numpy as np
import pytest
import torch

from lightserve.kernels.cpu import kernel_times, library, variant_library
from lightserve.kernels.decoder_layers import (
    CpuDecoderLayers,
    LayerArgs,
    LoraGroupArgs,
    LoraStep,
    ModelDims,
    QuantWeight,
    Scratch,
    StepArgs,
    timed_labels,
)
from lightserve.kernels.linear import (
    PAIR_MAX_M,
    onednn_runs_bf16,
    pack_linear_weight,
    pairs_take_every_m,
    unpack_linear_weight,
)
from lightserve.kernels.prefill_attention import sdpa_takes_fresh_prefills
from lightserve.kernels.quant_linear import QuantLinear
from lightserve.model_infer.lora import LoraGroup, LoraLimits, LoraWeights
from tests.kernels.kernel_cases import c_library_variants

from .fake_worker import FakeWorker
from .tiny_models import load_model_dir, make_tiny_model

# head_dim 64 (what the C decode attention is built for); GQA groups 2, 3 and 1.
SHAPES = {"llama3": (256, 4, 2), "qwen2": (192, 3, 1), "llama_bias": (128, 2, 2), "mistral_window": (256, 4, 2),
          "phi3": (128, 2, 1), "qwen3": (256, 4, 2)}  # (hidden, heads, kv heads)


def bf16_in_c() -> bool:
    return pairs_take_every_m(library())


def load_pair(arch: str, dtype: torch.dtype, tmp_path) -> tuple:
    """(one-call model, per-kernel model) of one tiny checkpoint."""
    hidden, heads, kv_heads = SHAPES[arch]
    model_dir = make_tiny_model(arch, tmp_path, hidden_size=hidden, num_attention_heads=heads,
                                num_key_value_heads=kv_heads, **({"head_dim": 64} if arch == "qwen3" else {}))
    fused = load_model_dir(model_dir, dtype=dtype)
    loop = load_model_dir(model_dir, dtype=dtype)
    loop.cpu_layers = None
    return fused, loop


def one_call_steps(every_step: bool, dtype: torch.dtype) -> list[int]:
    """The token counts of run_steps' steps the driver runs: the decode steps where it takes up to PAIR_MAX_M
    tokens; every step where it takes any number, except the first (a prefill with nothing cached) where torch's SDPA
    runs such prefills in the per-kernel loop (bf16 on AMX CPUs whose C attention has no tiles; head_dim 64)."""
    if not every_step:
        return [4, 4, 4]
    return [4, 4, 4, 22] if sdpa_takes_fresh_prefills(dtype, dtype, 64) else [65, 4, 4, 4, 22]


def count_one_call_steps(model) -> list[int]:
    """From now on, the token count of every step the model's one-call driver runs, appended to the returned list."""
    calls, run = [], model.cpu_layers.run

    def counted(residual, *args):
        calls.append(residual.shape[0])
        return run(residual, *args)

    model.cpu_layers.run = counted
    return calls


def run_steps(model, gen_seed: int = 0, lora_slots: dict[int, int] | None = None,
              kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """A ragged prefill (65 tokens), three decode steps of 4 tokens (greedy), then 3 decodes beside a prefix-hit
    extend and a fresh prefill (22 tokens): the logits of every step, then every layer's K and V. lora_slots: each
    request row's LoRA slot (rows 0-5; -1 or absent: the base model). kv_dtype: the cache's (None: the model's)."""
    gen = torch.Generator().manual_seed(gen_seed)
    vocab = model.config.vocab_size
    worker = FakeWorker(model, kv_dtype=kv_dtype)

    def step(items, **kw):
        slots = None if lora_slots is None else [lora_slots.get(row, -1) for row, _ in items]
        return worker.step(items, lora_slots=slots, **kw)

    seqs = {row: torch.randint(3, vocab, (n,), generator=gen).tolist() for row, n in enumerate((5, 19, 1, 40))}
    out = [step([(row, s) for row, s in seqs.items()], num_decode=0, all_logits=True)]  # [T, V]
    last = torch.tensor([len(s) for s in seqs.values()]).cumsum(0) - 1  # each request's last token in [T]
    logits = out[0][last]  # [B, V]
    for _ in range(3):
        for row, tok in zip(seqs, logits.argmax(-1).tolist()):
            seqs[row].append(tok)
        logits = step([(row, [s[-1]]) for row, s in seqs.items()], num_decode=len(seqs))
        out.append(logits)
    worker.share_prefix(4, 1, 6)
    items = [(row, [seqs[row][-1]]) for row in (0, 1, 2)] + [
        (4, torch.randint(3, vocab, (7,), generator=gen).tolist()),
        (5, torch.randint(3, vocab, (12,), generator=gen).tolist())]
    out.append(step(items, num_decode=3))
    cache = worker.kv_cache
    scales = [s for s in (*cache.k_scales, *cache.v_scales) if isinstance(s, torch.Tensor)]  # int8's
    return out + list(cache.k_caches) + list(cache.v_caches) + scales


def random_lora_store(model, targets: dict[int, tuple[LoraGroup, ...]],
                      stack_dtype: torch.dtype = torch.float32) -> LoraWeights:
    """A LoRA store of 3 slots of rank 8 over the model, attached to it: slot -> the groups its random adapter targets
    (every layer; rank 8 in some blocks and 3 in others, so the padding matters); a slot not in `targets` is empty.
    stack_dtype: --lora_dtype's."""
    store = LoraWeights(model.config, model.weights.shards, LoraLimits(3, 8, dtype=stack_dtype), "cpu")
    gen = torch.Generator().manual_seed(11)
    for slot, groups in targets.items():
        for layer, stacks in enumerate(store.layers):
            for group in groups:
                buffers = stacks[group]
                for r0, rj, n0, nj in buffers.slices:
                    rank = rj if (r0 // rj + slot) % 2 == 0 else 3
                    a, bt = buffers.a[slot, r0:r0 + rank], buffers.bt[slot, r0:r0 + rank, n0:n0 + nj]
                    a.copy_(torch.randn(a.shape, generator=gen) * 0.3)     # [rank, K]
                    bt.copy_(torch.randn(bt.shape, generator=gen) * 0.3)   # [rank, nj]
                store.targeted[layer, group, slot] = 1
    model.attach_lora(store)
    return store


EVERY_GROUP = tuple(LoraGroup)
# Rows 0 and 3 under slot 0, rows 2 and 4 under slot 1 (no gate_up: its step still runs the fused float32 MLP where
# no slot-0 token is in it), rows 1 and 5 the base model; the mixed step's extends run one adapter each.
MIXED_SLOTS = {0: 0, 2: 1, 3: 0, 4: 1, 5: 0}
LORA_TARGETS = {0: EVERY_GROUP, 1: (LoraGroup.QKV_PROJ, LoraGroup.O_PROJ, LoraGroup.DOWN_PROJ)}


def check_lora_steps(fused, loop, lora_slots: dict[int, int], every_step: bool = True,
                     stack_dtype: torch.dtype = torch.float32) -> None:
    """Both models on the same adapters: the one-call steps bit for bit the loop's, and the adapters matter."""
    store = random_lora_store(fused, LORA_TARGETS, stack_dtype)
    loop.attach_lora(store)
    calls = count_one_call_steps(fused)
    with kernel_times() as times:
        got = run_steps(fused, lora_slots=lora_slots)
    want = run_steps(loop, lora_slots=lora_slots)
    for g, ref in zip(got, want, strict=True):
        assert torch.equal(g, ref)
    assert calls == one_call_steps(every_step, fused.dtype)
    assert times["lora_cpu"] > 0 and "decoder_layers_cpu" not in times
    assert not torch.equal(got[1], run_steps(loop)[1])  # the deltas change the logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama3", "llama_bias", "qwen3"])
def test_lora_steps_run_in_one_call_bit_for_bit(arch, dtype, tmp_path):
    """Steps whose tokens mix the base model and two adapters (one targeting every projection, one not gate_up),
    decodes beside prefills: the driver adds each delta where the loop does (qkv's before the q/k norms and rotary,
    gate_up's before the activation), with the same kernel and arguments, so its results are the loop's bits."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair(arch, dtype, tmp_path)
    check_lora_steps(fused, loop, MIXED_SLOTS, fused.cpu_layers.max_tokens is None)


def test_lora_steps_over_bf16_stacks_run_in_one_call_bit_for_bit(tmp_path):
    """--lora_dtype bfloat16 over float32 activations: the driver tells lora.c the stacks' dtype
    (LoraGroupArgs.w_bf16), so its deltas are the loop's bits over the same bf16 stacks."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair("llama3", torch.float32, tmp_path)
    check_lora_steps(fused, loop, MIXED_SLOTS, stack_dtype=torch.bfloat16)


def test_lora_steps_without_a_gate_up_adapter_keep_the_fused_mlp(tmp_path):
    """float32, every LoRA token under the slot whose adapter has no gate_up: the MLP runs gate_up with its SiLU
    epilogue in one kernel, as without adapters, and the qkv, o and down deltas still match the loop's bits."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair("llama3", torch.float32, tmp_path)
    check_lora_steps(fused, loop, {0: 1, 3: 1, 4: 1})
    with kernel_times() as times:
        run_steps(fused, lora_slots={0: 1, 3: 1, 4: 1})
    assert "silu_and_mul_cpu" not in times
    with kernel_times() as times:
        run_steps(fused, lora_slots={0: 0})
    assert times["silu_and_mul_cpu"] > 0  # gate_up's delta goes between the GEMM and the activation


def test_lora_on_projections_in_ggml_blocks_runs_in_one_call_bit_for_bit(tmp_path):
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair("llama3", torch.float32, tmp_path)
    quantize_projections(fused)
    quantize_projections(loop)
    loop.cpu_layers = None
    assert fused.cpu_layers is not None and fused.cpu_layers.quant[0]
    check_lora_steps(fused, loop, MIXED_SLOTS)


def test_a_lora_slot_filled_later_is_read_in_place(tmp_path):
    """The driver binds the store once: a slot filled after attach_lora (as LoadLora does) takes effect at the next
    step, and one emptied again runs the base model."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair("llama3", torch.float32, tmp_path)
    store = random_lora_store(fused, {})
    loop.attach_lora(store)
    base = run_steps(loop)
    assert all(torch.equal(g, b) for g, b in zip(run_steps(fused, lora_slots=MIXED_SLOTS), base, strict=True))
    full = random_lora_store(loop, LORA_TARGETS)  # the loop on a filled store; the driver's store filled in place
    for stacks, filled in zip(store.layers, full.layers):
        for group, buffers in stacks.items():
            buffers.a.copy_(filled[group].a)
            buffers.bt.copy_(filled[group].bt)
    store.targeted[...] = full.targeted
    for g, ref in zip(run_steps(fused, lora_slots=MIXED_SLOTS), run_steps(loop, lora_slots=MIXED_SLOTS),
                      strict=True):
        assert torch.equal(g, ref)
    store.targeted[...] = 0
    assert all(torch.equal(g, b) for g, b in zip(run_steps(fused, lora_slots=MIXED_SLOTS), base, strict=True))


def test_bind_lora_refuses_stacks_of_other_shapes_and_dtypes(tmp_path):
    """Stacks of another shape, a bf16 bt beside a float32 a, float16 stacks (lora.c reads none), a bool table:
    ValueError. A model given a store of float16 stacks drops its driver instead (its steps run kernel by kernel)."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, _ = load_pair("llama3", torch.float32, tmp_path)
    store = LoraWeights(fused.config, fused.weights.shards, LoraLimits(2, 4), "cpu")
    stacks = store.stacks()
    a, bt, slices = stacks[1][LoraGroup.O_PROJ]
    stacks[1][LoraGroup.O_PROJ] = (a[:, :, :-1].contiguous(), bt, slices)
    with pytest.raises(ValueError, match="layer 1 group 1"):
        fused.cpu_layers.bind_lora(stacks, store.targeted)
    with pytest.raises(ValueError, match="targeted table"):
        fused.cpu_layers.bind_lora(store.stacks(), store.targeted.astype(bool))
    stacks[1][LoraGroup.O_PROJ] = (a, bt.bfloat16(), slices)  # a float32, bt bf16
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        fused.cpu_layers.bind_lora(stacks, store.targeted)
    stacks[1][LoraGroup.O_PROJ] = (a.half(), bt.half(), slices)
    with pytest.raises(ValueError, match="layer 1 group 1"):
        fused.cpu_layers.bind_lora(stacks, store.targeted)
    fused.attach_lora(LoraWeights(fused.config, fused.weights.shards, LoraLimits(2, 4, dtype=torch.float16), "cpu"))
    assert fused.cpu_layers is None
    assert np.all(store.targeted == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(SHAPES))
def test_one_call_layers_match_the_per_kernel_forward_bit_for_bit(arch, dtype, tmp_path):
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair(arch, dtype, tmp_path)
    assert fused.cpu_layers is not None
    # bf16 GEMMs on oneDNN above PAIR_MAX_M rows here (AMX without the tile GEMM): the driver runs the decode steps.
    # Without native bf16 products the float32 panels run them, in the driver too.
    every_step = dtype == torch.float32 or bf16_in_c() or not onednn_runs_bf16()
    assert fused.cpu_layers.max_tokens == (None if every_step else PAIR_MAX_M)
    calls = count_one_call_steps(fused)
    want = run_steps(loop)
    for got, ref in zip(run_steps(fused), want, strict=True):
        assert torch.equal(got, ref)
    # A second KV cache handed to the same model: its pointers are bound anew, the results the same.
    for got, ref in zip(run_steps(fused), want, strict=True):
        assert torch.equal(got, ref)
    assert calls == 2 * one_call_steps(every_step, dtype)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_one_call_layers_over_an_8bit_cache_match_the_per_kernel_forward(dtype, kv_dtype, tmp_path):
    """The driver decides from the cache's format what the per-kernel forward decides from its dtype: an int8 cache
    has q and k through the Walsh-Hadamard transform after the rotary, an fp8 one not; logits, cache bytes and int8
    scales bit for bit. Qwen3's q/k norms: the rows the transform reads are the norms' buffers there."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair("qwen3", dtype, tmp_path)
    calls = count_one_call_steps(fused)
    for got, ref in zip(run_steps(fused, kv_dtype=kv_dtype), run_steps(loop, kv_dtype=kv_dtype), strict=True):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           ref.view(torch.uint8) if ref.element_size() == 1 else ref)
    assert calls


def test_an_int8_cache_holds_k_through_the_walsh_hadamard_transform(tmp_path):
    """What the int8 cache holds, on both forwards: layer 0's K rows dequantized are the float cache's K rows (the
    same inputs, after the rotary) times the Walsh-Hadamard matrix, to within the int8 rounding of each row, and far
    from those rows unrotated; an fp8 cache holds them unrotated. (The driver and the loop agreeing, above, does not
    show that either applies the transform.)"""
    if library() is None:
        pytest.skip("no C compiler here")
    from lightserve.kernels.kv_store import dequantize_kv
    from lightserve.kernels.rotary import hadamard_ref

    models = load_pair("qwen3", torch.float32, tmp_path)
    vocab = models[0].config.vocab_size
    ids = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    for model in models:
        caches = {}
        for kv in (None, torch.int8, torch.float8_e4m3fn):
            worker = FakeWorker(model, kv_dtype=kv)
            worker.step([(0, ids)], num_decode=0)
            caches[kv] = worker.kv_cache
        rows = slice(1, 1 + len(ids))                                         # FakeWorker's first rows
        k = caches[None].k_caches[0][rows].float()                            # [T, Hk, D]
        int8 = caches[torch.int8]
        scales = int8.k_scales[0][rows]                                       # [T, Hk]
        got = dequantize_kv(int8.k_caches[0][rows], scales)
        step = scales[..., None]                                              # one int8 code of each row
        assert ((got - hadamard_ref(k)).abs() <= 0.51 * step).all()
        assert ((got - k).abs() > 4 * step).any()
        fp8 = caches[torch.float8_e4m3fn]
        torch.testing.assert_close(dequantize_kv(fp8.k_caches[0][rows], fp8.k_scales[0]), k, rtol=1 / 16, atol=1e-2)


def quantize_projections(model, int8_dot: bool = False) -> None:
    """Give every layer of a float32 model its projections kept in GGML blocks (the same weights quantized by the gguf
    package), then rebuild its one-call driver: q | k in one block type and v in another (two row segments, as a
    Q4_K_M file mixes them), K-quants where K is a multiple of 256 and 32-element blocks elsewhere (by the exporter's
    quantizers); with `int8_dot`, multiplied with int8 activations."""
    import dataclasses

    import gguf

    from lightserve.engine.gguf_export import quantize
    from lightserve.kernels.quant_linear import GGMLType, cat_rows, quant_tensor

    def blocks(w: torch.Tensor, qtype: GGMLType) -> QuantLinear:
        raw = quantize(w, gguf.GGMLQuantizationType(int(qtype)))
        return dataclasses.replace(quant_tensor(qtype, torch.from_numpy(raw), w.shape[1]), int8_dot=int8_dot)

    def pick(k: int, big: GGMLType, small: GGMLType) -> GGMLType:
        return big if k % 256 == 0 else small

    layers, kv = [], model.num_kv_heads * model.head_dim
    for layer in model.weights.layers:
        qkv, o, gate_up, down = (unpack_linear_weight(w) for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                                     layer.down_proj))
        k = qkv.shape[1]
        layers.append(dataclasses.replace(
            layer, qkv_proj=cat_rows([blocks(qkv[:-kv], pick(k, GGMLType.Q4_K, GGMLType.Q4_1)),
                                      blocks(qkv[-kv:], pick(k, GGMLType.Q6_K, GGMLType.Q8_0))]),
            o_proj=blocks(o, pick(o.shape[1], GGMLType.Q5_K, GGMLType.Q5_0)),
            gate_up_proj=blocks(gate_up, pick(k, GGMLType.Q4_K, GGMLType.Q4_0)),
            down_proj=blocks(down, pick(down.shape[1], GGMLType.Q6_K, GGMLType.Q5_1))))
    model.weights = dataclasses.replace(model.weights, layers=layers)
    model.cpu_layers = model._build_cpu_layers()


@pytest.mark.parametrize("int8_dot", [False, True], ids=["float_act", "int8_act"])
@pytest.mark.parametrize("arch", ["llama3", "llama_bias"])
def test_projections_in_ggml_blocks_run_in_one_call_bit_for_bit(arch, int8_dot, tmp_path):
    """A float32 model whose projections are kept in GGML blocks (a GGUF checkpoint): the driver runs quant_linear.c's
    kernel on them segment by segment, bit for bit the per-kernel forward, at every step. With int8 activations
    (int8_dot) every step runs quant_linear_q8 (the 4-token decode steps its GEMV, the prefills its GEMM), in both
    forwards alike: their logits differ from the float activations' ones."""
    if library() is None:
        pytest.skip("no C compiler here")
    fused, loop = load_pair(arch, torch.float32, tmp_path)
    quantize_projections(fused, int8_dot)
    quantize_projections(loop, int8_dot)
    loop.cpu_layers = None
    assert fused.cpu_layers is not None and fused.cpu_layers.max_tokens is None
    assert len(fused.weights.layers[0].qkv_proj.segments) == 2
    assert all(fused.cpu_layers.quant[0][name].int8_dot == int8_dot for name in ("qkv", "o_proj", "gate_up", "down"))
    calls = count_one_call_steps(fused)
    got_steps = run_steps(fused)
    for got, ref in zip(got_steps, run_steps(loop), strict=True):
        assert torch.equal(got, ref)
    assert calls == [65, 4, 4, 4, 22]
    if int8_dot:  # every step took the int8 path: the same model with float activations computes otherwise
        import dataclasses

        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        layers = [dataclasses.replace(layer, **{n: dataclasses.replace(getattr(layer, n), int8_dot=False)
                                                for n in names}) for layer in loop.weights.layers]
        loop.weights = dataclasses.replace(loop.weights, layers=layers)
        float_steps = run_steps(loop)
        assert not torch.equal(got_steps[0], float_steps[0])  # the 65-token prefill: the int8 GEMM
        assert not torch.equal(got_steps[1], float_steps[1])


def test_bf16_weights_with_a_onednn_copy_run_the_decode_steps_in_one_call(tmp_path, monkeypatch):
    """What an AMX CPU loads: each bf16 projection in oneDNN's layout (which runs M over PAIR_MAX_M) beside
    linear.c's pairs. Forced here with LIGHTSERVE_ONEDNN_BF16_GEMM on any CPU whose oneDNN has a bf16 path: the steps
    of up to PAIR_MAX_M tokens run in one call, the others the loop, bit for bit as the loop alone. Where oneDNN has
    none (AVX2 only) the weights get float32 panels instead, and the driver takes every step."""
    if library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("LIGHTSERVE_ONEDNN_BF16_GEMM", "1")
    fused, loop = load_pair("qwen3", torch.bfloat16, tmp_path)
    onednn = onednn_runs_bf16()
    assert fused.cpu_layers.max_tokens == (PAIR_MAX_M if onednn else None)
    gate_ups = [layer.gate_up for layer in fused.cpu_layers.layers]
    large_m = [w.onednn if onednn else w.widened for w in gate_ups]
    assert all(w.pairs is not None for w in gate_ups) and all(c is not None for c in large_m)
    calls = count_one_call_steps(fused)
    for got, ref in zip(run_steps(fused), run_steps(loop), strict=True):
        assert torch.equal(got, ref)
    assert calls == ([4, 4, 4] if onednn else [65, 4, 4, 4, 22])


@pytest.mark.parametrize("arch", ["llama3", "llama_bias", "qwen3"])
def test_bf16_weights_with_float32_panels_run_every_step_in_one_call(arch, tmp_path, monkeypatch):
    """What a CPU without native bf16 products loads (AVX2 only, or AVX-512 without AVX512-BF16): linear.c's pairs
    beside float32 panels, with no oneDNN copy. Forced here on any CPU. The driver widens x, runs the float32 GEMM
    and rounds its output over PAIR_MAX_M rows, as linear() does, so it takes every step, bit for bit as the loop
    (llama_bias: the biases in float32 too)."""
    if library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("LIGHTSERVE_ONEDNN_BF16_GEMM", "1")  # the pairs do not take every M
    monkeypatch.setattr(sys.modules["lightserve.kernels.linear"], "onednn_runs_bf16", lambda: False)
    fused, loop = load_pair(arch, torch.bfloat16, tmp_path)
    layers = fused.cpu_layers
    assert layers.widened and layers.max_tokens is None
    assert all(w.onednn is None and w.widened is not None and w.pairs is not None
               for layer in layers.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    calls = count_one_call_steps(fused)
    for got, ref in zip(run_steps(fused), run_steps(loop), strict=True):
        assert torch.equal(got, ref)
    assert calls == one_call_steps(True, torch.bfloat16)


def test_float32_gate_up_runs_fused_or_as_two_kernels_bit_for_bit(tmp_path):
    """The driver runs float32 gate_up with its SiLU epilogue in one kernel where the intermediate size is a multiple
    of the panel width (the tiny models' 128 in the test above) and as the GEMM then silu_and_mul where it is not
    (72 here): both give the per-kernel loop's bits."""
    if library() is None:
        pytest.skip("no C compiler here")
    hidden, heads, kv_heads = SHAPES["llama3"]
    model_dir = make_tiny_model("llama3", tmp_path, hidden_size=hidden, num_attention_heads=heads,
                                num_key_value_heads=kv_heads, intermediate_size=72)
    fused, loop = load_model_dir(model_dir, dtype=torch.float32), load_model_dir(model_dir, dtype=torch.float32)
    loop.cpu_layers = None
    assert fused.cpu_layers is not None
    with kernel_times() as times:
        got = run_steps(fused)
    for g, ref in zip(got, run_steps(loop), strict=True):
        assert torch.equal(g, ref)
    assert times["silu_and_mul_cpu"] > 0  # the activation ran as its own kernel


def test_an_empty_step_returns_no_rows(tmp_path):
    if library() is None:
        pytest.skip("no C compiler here")
    fused, _ = load_pair("llama3", torch.float32, tmp_path)
    kv = FakeWorker(fused).kv_cache
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    residual = torch.zeros(0, fused.config.hidden_size)
    out = fused.cpu_layers.run(residual, kv.k_caches, kv.v_caches, kv.req_to_token, torch.zeros(0, dtype=torch.int64),
                               torch.zeros(0, dtype=torch.int64), 0, *([empty_i32] * 6))
    assert out.shape == (0, fused.config.hidden_size)


@pytest.mark.parametrize("variant", [v for v in c_library_variants() if v != "native"])
def test_one_call_layers_of_every_build_this_cpu_runs(variant, tmp_path):
    """The driver from a narrower build (AVX-512 without vdpbf16ps, AVX2, or no AVX at all) against the native
    build's: float32 on weights packed for that build's panels, logits to rounding (the vector widths sum in other
    orders); bf16 on the same pairs, which those builds run up to PAIR_MAX_M rows (no vdpbf16ps), so the driver
    there takes the decode steps."""
    lib = variant_library(variant)
    fused, _ = load_pair("qwen2", torch.float32, tmp_path)
    native = run_steps(fused)
    layers = [dataclasses.replace(layer, **{name: pack_linear_weight(unpack_linear_weight(getattr(layer, name)), lib)
                                            for name in ("qkv", "o_proj", "gate_up", "down")})
              for layer in fused.cpu_layers.layers]
    fused.cpu_layers = CpuDecoderLayers.build(layers, fused.cpu_layers.shape, torch.float32, lib=lib)
    assert fused.cpu_layers is not None
    for got, want in zip(run_steps(fused), native, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)

    fused, _ = load_pair("qwen2", torch.bfloat16, tmp_path / "bf16")
    native = run_steps(fused)
    # Float32 panels (a CPU without native bf16) of this build's width: the driver runs them over PAIR_MAX_M rows.
    widened = all(w.widened is not None and w.widened.panel == lib.linear_panel_width()
                  for layer in fused.cpu_layers.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    fused.cpu_layers = CpuDecoderLayers.build(fused.cpu_layers.layers, fused.cpu_layers.shape, torch.bfloat16, lib=lib)
    assert fused.cpu_layers.max_tokens == (None if widened else PAIR_MAX_M)
    calls = count_one_call_steps(fused)
    steps = run_steps(fused)
    assert calls == one_call_steps(widened, torch.bfloat16)
    for got, want in zip(steps[1:4], native[1:4], strict=True):  # the decode steps' logits: bf16 sums in other orders
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


def test_kernel_times_report_each_kernel_of_the_one_call_layers(tmp_path):
    if library() is None:
        pytest.skip("no C compiler here")
    fused, _ = load_pair("llama3", torch.float32, tmp_path)
    worker = FakeWorker(fused)
    worker.step([(0, [5, 6, 7, 8])], num_decode=0)
    with kernel_times() as times:
        worker.step([(0, [9])], num_decode=1)  # a decode step: no prefill attention
    # float32 gate_up runs with its SiLU epilogue (intermediate 128): no activation kernel of its own.
    want = set(timed_labels(torch.float32)) - {"prefill_attention_cpu", "silu_and_mul_cpu", "lora_cpu"}
    assert want <= set(times) and all(times[k] > 0 for k in want)
    assert not {"prefill_attention_cpu", "silu_and_mul_cpu", "lora_cpu", "decoder_layers_cpu"} & set(times)


@pytest.mark.parametrize("arch", ["gemma2", "mixtral"])
def test_models_whose_layers_differ_run_kernel_by_kernel(arch, tmp_path, monkeypatch):
    """Gemma's own forward, MoE feed-forward: a step never reaches the one-call driver."""
    def refuse(*_args, **_kw):
        raise AssertionError("the one-call driver ran")

    monkeypatch.setattr(CpuDecoderLayers, "run", refuse)
    model = load_model_dir(make_tiny_model(arch, tmp_path, hidden_size=256, num_attention_heads=4,
                                           num_key_value_heads=2, **({"head_dim": 64} if arch != "mixtral" else {})),
                           dtype=torch.float32)
    logits = FakeWorker(model).step([(0, [5, 6, 7])], num_decode=0)
    assert logits.shape == (1, model.config.vocab_size)


def test_head_dims_the_attention_kernels_do_not_take_run_kernel_by_kernel(tmp_path):
    model = load_model_dir(make_tiny_model("llama3", tmp_path), dtype=torch.float32)  # head_dim 16
    assert model.cpu_layers is None


def test_per_kernel_forward_env_switches_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTSERVE_PER_KERNEL_FORWARD", "1")
    hidden, heads, kv_heads = SHAPES["llama3"]
    model = load_model_dir(make_tiny_model("llama3", tmp_path, hidden_size=hidden, num_attention_heads=heads,
                                           num_key_value_heads=kv_heads), dtype=torch.float32)
    assert model.cpu_layers is None


def test_a_kv_loc_out_of_range_raises_and_leaves_the_cache(tmp_path):
    if library() is None:
        pytest.skip("no C compiler here")
    fused, _ = load_pair("llama3", torch.float32, tmp_path)
    worker = FakeWorker(fused)
    batch = worker.make_batch([(0, [5, 6, 7])], num_decode=0)
    batch.kv_locs[1] = worker.kv_cache.k_caches[0].shape[0]  # one past the last row
    before = [k.clone() for k in worker.kv_cache.k_caches]
    with pytest.raises(RuntimeError, match="store_kv_cpu failed at layer 0"):
        fused.forward(batch, worker.kv_cache)
    assert all(torch.equal(a, b) for a, b in zip(before, worker.kv_cache.k_caches))


@pytest.mark.parametrize("struct", [LayerArgs, ModelDims, StepArgs, Scratch, QuantWeight, LoraGroupArgs, LoraStep],
                         ids=lambda s: s.__name__)
def test_structs_match_the_c_side(struct):
    """The C driver reads each struct through a pointer: every ctypes mirror has its C struct's size and every field
    its C offset (decoder_layers.c's struct_layout: sizeof and offsetof by name, -1 for a field C does not have)."""
    lib = library()
    if lib is None:
        pytest.skip("no C compiler here")
    name = struct.__name__
    assert lib.struct_layout(name.encode()) == ctypes.sizeof(struct)
    offsets = {field: lib.struct_layout(f"{name}.{field}".encode()) for field, _ in struct._fields_}
    assert offsets == {field: getattr(struct, field).offset for field, _ in struct._fields_}
