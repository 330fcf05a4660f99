"""The server's warm-up launches every Triton specialization that serving does: on tiny llama3, mixtral and
deepseek_v3 checkpoints under the Triton backend (compiled on a GPU, the interpreter on CPU), the keys of the
steps of batches of 1 to 9 requests, prefill-only, decode-only and mixed, are all keys `ModelRunner.warm_up`
launched; also over an 8-bit KV cache (llama3 with int8, deepseek_v3's latent rows in fp8 e4m3), whose kernels are
variants of their own, with two LoRA adapters of different ranks and targets beside the base model (the LoRA
shrink and expand kernels), and with a drafter: a draft model of other shapes than the served one (it runs over
every step's tokens), and DeepSeek-V3's MTP layer (its catch-up rows, which every step runs, and the served model
keeping every token's state; the steps carry no drafts, so chained draft decodes are not among them). A key
first seen while serving is a 1-3 s compile in the middle of a step on a GPU.

On CPU the warm-up runs in Triton's interpreter for real, and the serving steps' launches are recorded without
running the kernel bodies: a key depends only on the launch's arguments (dtypes, pointer alignment, ints,
constexprs), never on the values a kernel writes, and the interpreter would take minutes for the 26 steps. On a GPU
everything runs."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.kernels.launch_keys import record_launches
from lightserve.model_infer.lora import LoraLimits
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import read_model_config

from .fake_worker import FakeWorker
from .test_lora import make_adapter
from .tiny_models import make_mtp_checkpoint, make_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_BATCH = 9
# Smaller than tiny_models' defaults where that cuts the interpreter's programs (one per token, head or tile):
# one layer of each kind (DeepSeek: a dense one and a MoE one), 2 query heads over 1 KV head, 32-wide experts.
SHAPES = {"llama3": {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1},
          "mixtral": {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                      "intermediate_size": 32},
          "deepseek_v3": {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}}


# A draft model of other shapes than its served llama3 (4 heads over 2 KV heads, 2 layers): its kernels' keys are
# its own, so the case fails unless ModelRunner.warm_up runs the drafter too.
DRAFT_SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
# (family, KV cache dtype: None = the activations', LoRA adapters: slots with --enable_lora, 0 = none, drafter:
# "draft" (a draft model of DRAFT_SHAPE), "mtp" (DeepSeek-V3's MTP layer, the served model's shapes) or None)
CASES = [(arch, None, 0, None) for arch in SHAPES] + [
    ("llama3", torch.int8, 0, None), ("deepseek_v3", torch.float8_e4m3fn, 0, None), ("llama3", None, 2, None),
    ("llama3", None, 0, "draft"), ("deepseek_v3", None, 0, "mtp")]


@pytest.fixture(scope="module", params=CASES,
                ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}" + ("-lora" if c[2] else "") +
                (f"-{c[3]}" if c[3] else ""))
def runner(request, tmp_path_factory):
    arch, kv_dtype, loras, drafter = request.param
    root = tmp_path_factory.mktemp(arch)
    if drafter == "mtp":
        shape = dict(SHAPES[arch])
        model_dir = make_mtp_checkpoint(root / "model", shape.pop("num_hidden_layers"), **shape)
    else:
        model_dir = make_tiny_model(arch, root, **SHAPES[arch])
    draft = None
    if drafter == "draft":
        draft_dir = make_tiny_model("llama3", root / "draft", **DRAFT_SHAPE)
        draft = (str(draft_dir), read_model_config(draft_dir))
    runner = ModelRunner(str(model_dir), read_model_config(model_dir), torch.float32, DEVICE, 0, 1, None,
                         num_req_rows=MAX_BATCH + 1, max_req_total_len=48, kv_size=1024,
                         kernel_backend=KernelBackend.TRITON, kv_dtype=kv_dtype,
                         lora=LoraLimits(loras, 8) if loras else None, draft=draft, mtp=drafter == "mtp")
    runner.lora_slots = []  # each request's slot in the serving steps (_serve): none without adapters
    if loras:  # adapters loaded after the warm-up in a server; their loading launches nothing
        runner.lora_slots = [-1, 0, 1]  # by request row, in turn: the base model and the two adapters
        for slot in range(loras):
            path = make_adapter(model_dir, root / f"adapter{slot}", slot, r=4 * (slot + 1), lora_alpha=8,
                                target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"][slot:])
            runner.load_lora(slot + 1, str(path), slot)
    return runner


def _serve(runner: ModelRunner) -> tuple[set, set[int]]:
    """Steps of 1 .. MAX_BATCH requests: a ragged prefill chunk of each, a decode of each, and (from 2 requests)
    all but the last decoding while the last extends. Returns the launch keys and the token counts of the steps."""
    worker = FakeWorker(runner.model, num_kv_rows=1, num_req_rows=1, max_len=1)  # plans only: its cache is unused
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    token_counts = set()
    with _bodies_skipped_in_the_interpreter(), record_launches() as log:
        for b in range(1, MAX_BATCH + 1):
            rows = list(range(b))
            steps = [([(r, ids(1 + (r + b) % 2)) for r in rows], 0),  # a new prompt or the next chunk of each
                     ([(r, ids(1)) for r in rows], b)]  # decode-only
            if b > 1:
                steps.append(([(r, ids(1)) for r in rows[:-1]] + [(rows[-1], ids(2))], b - 1))
            if b == MAX_BATCH:  # a one-token prompt alone: every per-step width and count at 1
                steps.append(([(MAX_BATCH, ids(1))], 0))
            for items, num_decode in steps:
                slots = [runner.lora_slots[r % 3] for r, _ in items] if runner.lora_slots else None
                plan = worker.make_plan(items, num_decode, lora_slots=slots)
                token_counts.add(len(plan.input_ids))
                runner.forward(plan)
    assert worker.next_kv_loc <= runner.kv_size  # the steps' rows stay below the warm-up's scratch row
    return log.keys, token_counts


def test_warm_up_launches_every_key_of_serving(runner):
    with record_launches() as warm:
        runner.warm_up()
    served, token_counts = _serve(runner)
    kernels = {name for name, _ in served}
    assert {"_decode_merge_kernel", "_rotary_kernel", "_rmsnorm_kernel"} <= kernels
    if runner.lora_slots:
        assert {"_shrink_kernel", "_expand_kernel"} <= kernels
    top_k = runner.model.config.num_experts_per_tok
    if runner.model.config.num_experts:
        assert "_grouped_gemm_kernel" in kernels
        # Every (token, k) pair count the MoE GEMMs can see, modulo 16 (top_k 2: the even residues).
        assert {t * top_k % 16 for t in token_counts} == set(range(0, 16, top_k))
    missing = sorted(served - warm.keys, key=str)
    assert not missing, "keys served but not warmed up:\n" + "\n".join(
        f"{name} {_diff(spec, warm.keys, name)}" for name, spec in missing)


@contextmanager
def _bodies_skipped_in_the_interpreter() -> Iterator[None]:
    """Under TRITON_INTERPRET, launches return at once (record_launches, entered inside, still sees each one)."""
    if DEVICE.type == "cuda":
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kwargs: None)
        yield


def _diff(spec: tuple, warmed: set, name: str) -> str:
    """The entries of `spec` that no warmed key of the same kernel has (what made the key new)."""
    seen = [s for n, s in warmed if n == name]
    if not seen:
        return "(kernel never warmed up)"
    closest = min(seen, key=lambda s: sum(a != b for a, b in zip(s, spec)))
    return str([a for a, b in zip(spec, closest) if a != b])
