"""The whole forward through the Triton kernels, the GPU code path, on CPU: `--kernel_backend triton` builds the
model's GPU layout (plain weights for F.linear, token-major KV, no C layers, no argmax head) and every dispatcher
launches its Triton kernel, here in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Tiny Llama,
Qwen3, Gemma 2, Mixtral and DeepSeek-V3 checkpoints in float32 (the interpreter's bf16 dot is wrong) against
transformers: a prompt prefilled in chunks, decode steps, a prefix-cache hit extended in a step that also decodes and
prefills (a mixed step), a decode batch padded to a CUDA-graph size as the graph runner pads it, and a batch mixing LoRA
adapters and the base model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.kernels.linear import PackedLinear, PrepackedLinear
from lightserve.model_infer.cuda_graph import GraphInputs
from lightserve.model_infer.models import load_model, read_model_config

from .fake_worker import FakeWorker
from .tiny_models import make_tiny_model

FAMILIES = ("llama3", "qwen3", "gemma2", "mixtral", "deepseek_v3")
TOL = {"atol": 3e-5, "rtol": 1e-5}
# What a step must not reach under the triton backend: the C kernels and the torch references the CPU path falls
# back to. Each is patched to raise while the tests run.
CPU_PATHS = {
    "lightserve.kernels.cpu": ["library"],
    "lightserve.kernels.rmsnorm": ["rmsnorm_ref", "add_rmsnorm_ref"],
    "lightserve.kernels.activation": ["silu_and_mul_ref", "gelu_tanh_and_mul_ref"],
    "lightserve.kernels.rotary": ["rotary_emb_ref"],
    "lightserve.kernels.kv_store": ["store_kv_ref"],
    "lightserve.kernels.decode_attention": ["decode_attention_ref"],
    "lightserve.kernels.prefill_attention": ["prefill_attention_ref"],
    "lightserve.kernels.mla_attention": ["mla_decode_attention_ref"],
    "lightserve.kernels.moe": ["fused_experts_cpu"],
}


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    import transformers

    model_dir = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(read_model_config(model_dir), model_dir, torch.float32, backend=KernelBackend.TRITON)
    return hf, ours, model_dir


@pytest.fixture
def no_cpu_paths(monkeypatch):
    import importlib

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} reached under the triton backend")
        return call

    for module, names in CPU_PATHS.items():
        mod = importlib.import_module(module)
        for name in names:
            monkeypatch.setattr(mod, name, refuse(f"{module}.{name}"))


def _fields(obj) -> list:
    """Every value held by a (nested) dataclass of weights, lists of layers included."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if isinstance(obj, (PackedLinear, PrepackedLinear)):
            return [obj]
        return [w for f in dataclasses.fields(obj) for w in _fields(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [w for item in obj for w in _fields(item)]
    return [obj]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of one unpadded sequence."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_triton_backend_builds_the_gpu_layout(tiny):
    _, ours, _ = tiny
    assert ours.backend is KernelBackend.TRITON
    assert getattr(ours, "cpu_layers", None) is None and ours.argmax_head is None
    holders = [ours.weights, *(block.weights for block in getattr(ours, "moe_blocks", {}).values()),
               *(layer.weights for layer in getattr(ours, "mla_layers", []))]
    weights = [ours.lm_head, *(w for holder in holders for w in _fields(holder))]
    assert any(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights)
    assert not any(isinstance(w, (PackedLinear, PrepackedLinear)) for w in weights)
    cache = ours.make_kv_cache(16, 2, 32)
    if hasattr(cache, "k_caches"):  # token-major: a row's heads back to back, as the Triton kernels index them
        k = cache.k_caches[0]
        assert k.stride() == (k.shape[1] * k.shape[2], k.shape[2], 1)


def test_chunked_prefill_prefix_hit_and_mixed_step_match_transformers(tiny, no_cpu_paths):
    hf, ours, _ = tiny
    gen = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    worker = FakeWorker(ours, num_kv_rows=256, num_req_rows=8, max_len=64)
    a = torch.randint(3, vocab, (19,), generator=gen).tolist()
    b = torch.randint(3, vocab, (6,), generator=gen).tolist()

    # Row 0 in chunks of 8, 8 and 3 tokens (every position's logits); row 1 joins the last chunk's step.
    for start in (0, 8):
        logits = worker.step([(0, a[start:start + 8])], num_decode=0, all_logits=True)
        torch.testing.assert_close(logits, hf_logits(hf, a)[start:start + 8], **TOL)
    logits = worker.step([(0, a[16:]), (1, b)], num_decode=0)
    torch.testing.assert_close(logits, torch.stack([hf_logits(hf, a)[-1], hf_logits(hf, b)[-1]]), **TOL)

    # Two decode steps of both, on our own greedy tokens.
    seqs = {0: a, 1: b}
    for _ in range(2):
        for row, ids in zip(seqs, logits.argmax(-1).tolist()):
            seqs[row] = seqs[row] + [ids]
        logits = worker.step([(row, seqs[row][-1:]) for row in seqs], num_decode=2)
        torch.testing.assert_close(logits, torch.stack([hf_logits(hf, seqs[row])[-1] for row in seqs]), **TOL)

    # A mixed step: rows 0 and 1 decode, row 3 extends 5 tokens after 12 cached ones of row 0 (a radix-cache hit),
    # row 4 prefills 7 from scratch.
    for row, ids in zip(seqs, logits.argmax(-1).tolist()):
        seqs[row] = seqs[row] + [ids]
    worker.share_prefix(3, 0, 12)
    seqs[3] = a[:12] + torch.randint(3, vocab, (5,), generator=gen).tolist()
    seqs[4] = torch.randint(3, vocab, (7,), generator=gen).tolist()
    items = [(0, seqs[0][-1:]), (1, seqs[1][-1:]), (3, seqs[3][12:]), (4, seqs[4])]
    logits = worker.step(items, num_decode=2)
    torch.testing.assert_close(logits, torch.stack([hf_logits(hf, seqs[row])[-1] for row, _ in items]), **TOL)


# The padding is the graph runner's, the same for every family: one plain family, one with a window and soft-capped
# scores, and the latent cache.
@pytest.mark.parametrize("tiny", ["llama3", "gemma2", "deepseek_v3"], indirect=True)
def test_decode_padded_to_a_graph_size_matches_transformers(tiny, no_cpu_paths):
    """Three decoding requests in a size-4 graph batch, as CudaGraphRunner replays them: the padding row points at a
    scratch KV row and request row 0 with length 1, and the three real rows come out as transformers has them."""
    hf, ours, _ = tiny
    gen = torch.Generator().manual_seed(2)
    vocab = ours.config.vocab_size
    scratch = 255
    worker = FakeWorker(ours, num_kv_rows=scratch + 1, num_req_rows=8, max_len=64)
    seqs = {row: torch.randint(3, vocab, (n,), generator=gen).tolist() for row, n in ((1, 9), (2, 4), (5, 13))}
    logits = worker.step([(row, ids) for row, ids in seqs.items()], num_decode=0)
    for row, tok in zip(seqs, logits.argmax(-1).tolist()):
        seqs[row] = seqs[row] + [tok]
    batch = worker.make_batch([(row, seqs[row][-1:]) for row in seqs], num_decode=3)
    inputs = GraphInputs(4, scratch, worker.kv_cache.req_to_token, max_seq_len=64)
    inputs.load(batch, 4)
    padded = ours.forward(inputs.batch(4), worker.kv_cache)  # [4, V]
    torch.testing.assert_close(padded[:3], torch.stack([hf_logits(hf, seqs[row])[-1] for row in seqs]), **TOL)


# int8 where the attention paths differ (Qwen3's head_dim 24, a power-of-two block masked; Gemma 2's window and
# soft-capping; DeepSeek's latent rows; Mixtral's attention is Llama's); fp8 (the same kernels with another decode
# of the byte) in one family with K/V heads and in DeepSeek's latent rows, e5m2 in the first alone; a bf16 cache under
# these float32 models (a float cache in another dtype than the activations) with K/V heads and latent rows: the
# interpreter's minutes go where the paths differ.
KV_CASES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "bfloat16": torch.bfloat16}
CASES_KV = [("qwen3", "int8"), ("gemma2", "int8"), ("deepseek_v3", "int8"), ("llama3", "fp8_e4m3"),
            ("deepseek_v3", "fp8_e4m3"), ("llama3", "fp8_e5m2"), ("llama3", "bfloat16"), ("deepseek_v3", "bfloat16")]


@pytest.mark.parametrize(("tiny", "kv_name"), CASES_KV, indirect=["tiny"])
def test_kv_cache_dtypes_through_triton_match_the_reference_path(tiny, kv_name, no_cpu_paths, monkeypatch):
    """An 8-bit KV cache, or a bf16 one under float32 activations, under the triton backend: the Triton store writes
    the bytes (and int8 scales) the reference writes, and the Triton attention reads them as the references do, so a
    prefill, two decode steps and a mixed step with a prefix hit give the reference path's logits (the same model, the
    references run step for step on a CPU copy of the same cache). Not bit for bit: K and V come out of other GEMMs
    (Triton's, torch's) a rounding apart, and where one lands the other side of a quantization (or bf16 rounding) tie
    the byte moves a step (rarely: at most 1% of them), and a logit with it (up to ~5e-4 measured, against ~0.1 and
    more from a misread format)."""
    _, ours, model_dir = tiny
    kv_dtype = KV_CASES[kv_name]
    gen = torch.Generator().manual_seed(3)
    vocab = ours.config.vocab_size
    a, b = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (13, 6))
    steps = [([(0, a), (1, b)], 0), ([(0, [5]), (1, [6])], 2), ([(0, [7]), (1, [8])], 2)]
    worker = FakeWorker(ours, num_kv_rows=128, num_req_rows=4, max_len=64, kv_dtype=kv_dtype)
    got = [worker.step(items, num_decode) for items, num_decode in steps]
    worker.share_prefix(2, 0, 9)
    got.append(worker.step([(0, [9]), (2, [3, 4])], num_decode=1))
    monkeypatch.undo()  # the references may run again
    ref_model = load_model(read_model_config(model_dir), model_dir, torch.float32, backend=KernelBackend.CPU)
    ref_worker = FakeWorker(ref_model, num_kv_rows=128, num_req_rows=4, max_len=64, kv_dtype=kv_dtype)
    want = [ref_worker.step(items, num_decode) for items, num_decode in steps]
    ref_worker.share_prefix(2, 0, 9)
    want.append(ref_worker.step([(0, [9]), (2, [3, 4])], num_decode=1))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=1e-3)
    for name in ("k", "v", "latent"):
        if hasattr(worker.kv_cache, name):
            g = getattr(worker.kv_cache, name).view(torch.uint8)
            w = getattr(ref_worker.kv_cache, name).contiguous().view(torch.uint8)
            assert (g != w).float().mean() <= 0.01, name


def test_lora_adapters_on_the_triton_path(tmp_path, no_cpu_paths, monkeypatch):
    """A batch mixing the base model and three adapters through the Triton LoRA kernels (interpreter), greedy-equal to
    transformers + peft with each adapter merged, the C LoRA kernels and the references never reached."""
    from lightserve.kernels import lora as lora_kernels

    from .test_lora import (
        ADAPTERS,
        NEW_TOKENS,
        REQS,
        attach_store,
        hf_greedy,
        hf_reference,
        make_adapter,
        prompts_for,
        run_ours,
        slots_of,
    )

    for name in ("lora_apply_ref", "lora_shrink_ref", "lora_expand_ref", "lora_apply_cpu"):
        monkeypatch.setattr(lora_kernels, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} reached"))
    base_dir = make_tiny_model("llama3", tmp_path / "base")
    adapters = {name: make_adapter(base_dir, tmp_path / name, seed, **args)
                for seed, (name, args) in enumerate(ADAPTERS.items())}
    prompts = prompts_for(read_model_config(base_dir).vocab_size)
    refs = {name: hf_reference(base_dir, adapters.get(name)) for name in (None, *ADAPTERS)}
    expected = [hf_greedy(refs[name], prompt, NEW_TOKENS) for prompt, (_, name) in zip(prompts, REQS)]
    assert any(tokens != hf_greedy(refs[None], prompt, NEW_TOKENS) for prompt, tokens in zip(prompts, expected))
    model = load_model(read_model_config(base_dir), base_dir, torch.float32, backend=KernelBackend.TRITON)
    attach_store(model, adapters)
    assert run_ours(model, prompts, slots_of(adapters), NEW_TOKENS) == expected
