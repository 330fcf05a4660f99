"""GGUF checkpoints served packed (model_infer/gguf_reader.py): tiny random checkpoints of every family GGUF serves,
written by lightserve.engine.gguf_export with a different GGML type on each kind of tensor (Q8_0, Q4_0, Q5_1, Q4_K,
Q6_K, Q5_K, Q4_1, Q5_0 and the fallback of a K-quant on rows of 96), loaded with their quantized weights kept as
QuantLinear. The reference is transformers over the same weights dequantized by transformers' own GGUF tensor
processing (which undoes llama.cpp's q/k permutation and Gemma's 1 + w), and greedy tokens must be its greedy tokens
by teacher forcing (tests/greedy_check.py). Also: --tp 2 gives rank 0 the same logits as one rank (packed vocab
shards padded with zero blocks); a tensor type that is not served, and a --tp that cuts blocks, are refused naming the
tensor; the bundled model's config, tokenizer and chat template read from its GGUF metadata are those of its
converted folder."""
from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightserve.config import Device, DType, ServerConfig
from lightserve.engine.gguf_export import export_gguf
from lightserve.kernels import cpu as kernels_cpu
from lightserve.kernels.quant_linear import QuantLinear
from lightserve.model_infer.models import check_gguf, load_weights, read_model_config
from lightserve.resolve_config import resolve_config
from tests.e2e.server import MODEL_DIR
from tests.greedy_check import greedy_mismatch

from .fake_worker import FakeWorker
from .tiny_models import load_model_dir, make_tiny_model

MIXED = ("attn_q=Q8_0,attn_k=Q4_0,attn_v=Q5_1,attn_output=Q4_K,ffn_gate=Q6_K,ffn_up=Q5_K,ffn_down=Q4_1,"
         "token_embd=Q8_0,output=Q6_K,*=Q5_0")
SIZES = {"hidden_size": 256, "intermediate_size": 512}  # K-quants need rows of whole 256-blocks
# Every family GGUF serves; Qwen3's o_proj rows of 96 take Q4_K's fallback (Q5_0). llama.cpp's qwen3moe has no dense
# layer, so the tiny Qwen3-MoE has none either.
FAMILIES = {"llama3": {}, "qwen2": {}, "qwen3": {}, "gemma2": {}, "gemma3": {}, "mixtral": {"intermediate_size": 256},
            "qwen3_moe": {"moe_intermediate_size": 256, "mlp_only_layers": []}}
NEW_TOKENS = 6
PROMPTS = [[5, 9, 17, 33, 2, 8, 101, 77, 12], [7, 7, 64], [129, 3, 11, 12, 40, 41]]


def gguf_checkpoint(kind: str, out_dir: Path, types: str = MIXED, **overrides) -> Path:
    """A folder holding the tiny checkpoint `kind` as `<kind>.gguf` (types by rule) and its HF config.json."""
    from safetensors.torch import load_file

    hf_dir = make_tiny_model(kind, out_dir / "hf", **{**SIZES, **FAMILIES.get(kind, {}), **overrides})
    folder = out_dir / "gguf"
    folder.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    export_gguf(load_file(hf_dir / "model.safetensors"), config, folder / f"{kind}.gguf", types)
    shutil.copy(hf_dir / "config.json", folder / "config.json")
    return folder


def dequantized_reference(folder: Path):
    """transformers' model of folder's config.json over the GGUF's weights dequantized to float32 by transformers'
    GGUF loader. Its name map knows Mistral and Mixtral as llama (their GGUF architecture), and it leaves Mixtral's
    3-D experts out: those are read here (gate | up rows per expert, as transformers 5 fuses them)."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    (path,) = folder.glob("*.gguf")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder),
                                                       dtype=torch.float32).eval()
    model_type = hf.config.model_type
    if model_type in ("mistral", "mixtral"):
        hf.config.model_type = "llama"
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    hf.config.model_type = model_type
    if model_type == "mixtral":
        raw = {t.name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type)))
               for t in gguf.GGUFReader(path).tensors if "_exps" in t.name}
        for i in range(hf.config.num_hidden_layers):
            gate, up, down = (raw[f"blk.{i}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
            tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
            tensors[f"model.layers.{i}.mlp.experts.down_proj"] = down  # [E, H, I]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head: tied
    return hf


def generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt: one ragged prefill, then batched decode steps."""
    worker = FakeWorker(model)
    logits = worker.step(list(enumerate(prompts)), num_decode=0)
    out = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(new_tokens - 1):
        logits = worker.step([(row, [toks[-1]]) for row, toks in enumerate(out)], num_decode=len(out))
        for toks, t in zip(out, logits.argmax(-1)):
            toks.append(int(t))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = gguf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, dequantized_reference(folder)


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(family):
    kind, folder, hf = family
    model = load_model_dir(folder, torch.float32)
    layer = model.weights.layers[0]
    assert isinstance(layer.qkv_proj, QuantLinear) and isinstance(layer.o_proj, QuantLinear)
    assert isinstance(model.weights.embed, QuantLinear) and model.argmax_head is None
    if kind in ("mixtral", "qwen3_moe"):
        assert all(isinstance(w, QuantLinear) for w in model.moe_blocks[0].weights.experts.down)
    else:
        assert {s.qtype.name for s in layer.gate_up_proj.segments} == {"Q6_K", "Q5_K"}
    for prompt, got in zip(PROMPTS, generate(model, PROMPTS, NEW_TOKENS)):
        problem = greedy_mismatch(hf, prompt, got)
        assert problem is None, f"{kind}: {problem}"


def test_bfloat16_activations_follow_float32(tmp_path):
    """The same packed weights under bf16 activations: logits within bf16 noise of the float32 model's."""
    folder = gguf_checkpoint("llama3", tmp_path)
    expected = FakeWorker(load_model_dir(folder, torch.float32)).step(list(enumerate(PROMPTS)), num_decode=0)
    got = FakeWorker(load_model_dir(folder, torch.bfloat16)).step(list(enumerate(PROMPTS)), num_decode=0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=0.1 * float(expected.abs().max()), rtol=0.0)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 2 / 3


def _mapped_kb(path: Path) -> int:
    """KB of this process's memory resident in mappings of `path` (/proc/self/smaps)."""
    target, kb, current = str(path.resolve()), 0, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            current = fields[5] if len(fields) > 5 else ""
        elif fields[0] == "Rss:" and current == target:
            kb += int(fields[1])
    return kb


def test_the_file_is_unmapped_once_loaded_without_waiting_for_the_cyclic_gc(tmp_path):
    """The weights are copies: once the model is loaded the file's mapping must be gone at once, not when the cyclic
    GC next runs (a worker went on holding a 1B model's 672 MiB of file pages beside its copies of them)."""
    import gc

    folder = gguf_checkpoint("llama3", tmp_path)
    gc.collect()
    gc.disable()
    try:
        model = load_model_dir(folder, torch.float32)
        assert _mapped_kb(folder / "llama3.gguf") == 0
    finally:
        gc.enable()
    assert isinstance(model.weights.layers[0].o_proj, QuantLinear)


def _rank_main(rank: int, port: int, folder: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model_dir(folder, torch.float32, tp_rank=rank, tp_size=2)
        logits = FakeWorker(model).step(list(enumerate(PROMPTS)), num_decode=0)
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("types, dtype", [("*=Q8_0", DType.FLOAT32), ("*=F16", DType.BFLOAT16)])
def test_auto_dtype_is_float32_for_packed_weights_on_a_native_bf16_cpu(tmp_path, monkeypatch, types, dtype):
    """--data_type auto on a CPU with native bf16 products: float32 activations where the GGUF's weights stay packed
    (their kernels and the one-call decoder layers take float32), bf16 where every tensor is a float one."""
    monkeypatch.setattr(kernels_cpu, "cpu_flags", lambda: "avx2 avx512f avx512_bf16")
    folder = gguf_checkpoint("llama3", tmp_path, types=types)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the server's tokenizer, beside the file
        shutil.copy(MODEL_DIR / name, folder / name)
    config = resolve_config(ServerConfig(model_dir=str(folder), device=Device.CPU, data_type=DType.AUTO))
    assert config.data_type is dtype and config.kv_cache_dtype.value == dtype.value


def test_tp2_logits_equal_tp1(tmp_path):
    """Two ranks with an odd vocabulary (the last rank's packed embedding padded with zero blocks), one KV head
    (replicated); o_proj's per-rank slices of 128 columns need 32-blocks (Q8_0), down's of 256 take Q4_K."""
    folder = gguf_checkpoint("llama3", tmp_path, types="attn_output=Q8_0,ffn_down=Q4_K,*=Q4_0", vocab_size=131,
                             num_key_value_heads=1)
    config = read_model_config(folder)
    check_gguf(next(folder.glob("*.gguf")), config, 2)
    expected = FakeWorker(load_model_dir(folder, torch.float32)).step(list(enumerate(PROMPTS)), num_decode=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = tmp_path / "tp_logits.pt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(folder), str(out_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    torch.testing.assert_close(torch.load(out_path), expected, atol=1e-4, rtol=1e-4)


def test_tp_that_cuts_blocks_is_refused(tmp_path):
    folder = gguf_checkpoint("llama3", tmp_path, types="q4_k")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight.*Q4_K blocks of 256"):
        check_gguf(next(folder.glob("*.gguf")), read_model_config(folder), 2)


def test_unsupported_type_is_refused_naming_the_tensor(tmp_path):
    import gguf

    folder = gguf_checkpoint("qwen2", tmp_path, types="q8_0")
    path = next(folder.glob("*.gguf"))
    # The same file with blk.1.ffn_up.weight as Q2_K (bytes of the right size; the type is what is refused).
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(tmp_path / "q2k.gguf", "qwen2")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name == "blk.1.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
            writer.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.unlink()
    config = read_model_config(folder)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight has GGML type Q2_K"):
        check_gguf(tmp_path / "q2k.gguf", config, 1)
    shutil.move(tmp_path / "q2k.gguf", folder / "q2k.gguf")
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight has GGML type Q2_K"):
        load_weights(folder, config, torch.float32)


def test_bundled_model_metadata_from_its_gguf_matches_the_converted_folder():
    """prepare_gguf (the launcher's folder for a GGUF without HF files beside) against the float32 conversion: the
    same config (but the saved dtype), tokens and chat template, and a link to the weights."""
    from transformers import AutoTokenizer

    from lightserve.engine.model_prep import default_gguf, ensure_default_model, prepare_gguf

    folder, converted = prepare_gguf(default_gguf()), ensure_default_model()
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (folder, converted))
    assert {k: v for k, v in ours.items() if k != "dtype"} == {k: v for k, v in theirs.items() if k != "dtype"}
    assert read_model_config(folder) == read_model_config(converted)
    assert (folder / default_gguf().name).resolve() == default_gguf().resolve()
    tok, ref = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(converted)
    for text in ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text), text
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok.chat_template == ref.chat_template
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (folder / "generation_config.json").read_text() == (converted / "generation_config.json").read_text()
