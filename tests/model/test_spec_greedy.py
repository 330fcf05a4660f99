"""Speculative decoding's exactness at the model: for every served family (tiny random checkpoints) and both dtypes,
greedy decoding one token a step and greedy decoding with drafts verified in one multi-token extend (the prefill
attention kernels' query rows after a cached prefix, logits at every draft position: BatchPlan.spec_lens) produce
the same tokens, whether the drafts are right, partly wrong or wrong from the first. Rejected drafts' KV rows are
overwritten by the next step, as the router hands them to other tokens.

float32 is bit-exact here. In bfloat16 a row's logits depend on how many rows its GEMMs and attention compute
together (other kernels, other rounding), so at a near tie the two paths may pick different tokens, as a decode at
batch 1 and at batch 8 may: there the outputs must agree up to the first difference, and that difference must be a
tie of both runs' logits within TIE_STEPS steps of bfloat16's spacing at the top logit (scripts/gpu_check.py's
rule), or the token a whole-sequence prefill of that prefix picks (the prefill path's numerics, which a chunked
prompt has without speculation too: in DeepSeek-V3's bfloat16 MLA + MoE a rounding difference can flip an expert
choice and move a logit by whole units); the rest of the two outputs then legitimately differ."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.messages import BatchPlan
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.spec_verify import accept_greedy

from .tiny_models import ARCHS, make_tiny_model

NEW_TOKENS = 24
K = 4
TIE_STEPS = {torch.float32: 0, torch.bfloat16: 4}
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7}


def _generate(model, prompt: list[int], draft_for) -> tuple[list[int], int, list[torch.Tensor]]:
    """Greedy tokens after `prompt` on request row 0, KV row = position; draft_for(seq) gives the drafts of a step
    ([]: a plain decode). Returns (output tokens, steps, the logits row [V] each token was chosen from)."""
    rows: list[torch.Tensor] = []
    cache = model.make_kv_cache(256, 2, 128)
    staging = HostStaging(model.device)
    seq, computed, steps = list(prompt), 0, 0
    while len(seq) - len(prompt) < NEW_TOKENS:
        drafts = draft_for(seq) if computed else []
        new = seq[computed:] + drafts
        plan = BatchPlan(step=steps, shm_indices=np.zeros(1, np.int32), req_ids=np.ones(1, np.int64),
                         prefix_lens=np.array([computed], np.int32), extend_lens=np.array([len(new)], np.int32),
                         sample=np.ones(1, bool), input_ids=np.array(new, np.int32),
                         kv_locs=np.arange(computed, computed + len(new), dtype=np.int32),
                         num_decode=int(len(new) == 1), **({"spec_lens": np.array([len(drafts)], np.int32)}
                                                           if drafts else {}))
        with torch.inference_mode():
            logits = model.forward(make_forward_batch(plan, cache.req_to_token, staging), cache)
        targets = logits.argmax(-1).numpy()                                  # [1 + k]
        assert targets.shape == (1 + len(drafts),)
        accepted = int(accept_greedy(targets, np.array(drafts, np.int64), np.array([1 + len(drafts)]))[0])
        seq += drafts[:accepted] + [int(targets[accepted])]
        rows += list(logits[: accepted + 1].float())
        computed = len(seq) - 1
        steps += 1
    return seq[len(prompt): len(prompt) + NEW_TOKENS], steps, rows[:NEW_TOKENS]


def _prefill_argmax(model, seq: list[int]) -> int:
    """The greedy token after `seq` computed by one prefill of all of it."""
    cache = model.make_kv_cache(256, 2, 128)
    n = len(seq)
    plan = BatchPlan(step=0, shm_indices=np.zeros(1, np.int32), req_ids=np.ones(1, np.int64),
                     prefix_lens=np.zeros(1, np.int32), extend_lens=np.array([n], np.int32), sample=np.ones(1, bool),
                     input_ids=np.array(seq, np.int32), kv_locs=np.arange(n, dtype=np.int32), num_decode=0)
    with torch.inference_mode():
        return int(model.forward(make_forward_batch(plan, cache.req_to_token, HostStaging(model.device)),
                                 cache)[0].argmax())


def _is_tie(row: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> bool:
    spacing = 2.0 ** (int(np.floor(np.log2(float(row.abs().max())))) - MANTISSA_BITS[dtype])
    return abs(float(row[a]) - float(row[b])) <= TIE_STEPS[dtype] * spacing


@pytest.mark.parametrize("arch, dtype, backend", [
    *((arch, dtype, KernelBackend.CPU) for arch in ARCHS for dtype in (torch.float32, torch.bfloat16)),
    # The GPU code path (Triton's prefill kernel scores the drafts), in Triton's interpreter: float32 only, as the
    # interpreter's bf16 dots are not trusted (tests/kernels); scripts/gpu_check.sh runs the GPU.
    ("llama3", torch.float32, KernelBackend.TRITON)],
    ids=lambda v: v if isinstance(v, str) else str(v).rsplit(".", 1)[-1].lower())
def test_speculated_greedy_equals_plain_greedy(arch, dtype, backend, tmp_path):
    from lightserve.model_infer.models import load_model, read_model_config

    model_dir = make_tiny_model(arch, tmp_path)
    model = load_model(read_model_config(model_dir), model_dir, dtype, backend=backend)
    prompt = torch.randint(3, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    plain, plain_steps, plain_rows = _generate(model, prompt, lambda seq: [])
    assert plain_steps == NEW_TOKENS
    truth = prompt + plain

    def drafts(seq: list[int]) -> list[int]:
        # The true next tokens, with every third step's second draft and every fifth step's first one wrong.
        out = truth[len(seq): len(seq) + K]
        step = len(seq)
        if out and step % 3 == 0 and len(out) > 1:
            out[1] = (out[1] + 1) % model.config.vocab_size
        if out and step % 5 == 0:
            out[0] = (out[0] + 7) % model.config.vocab_size
        return out

    spec, spec_steps, spec_rows = _generate(model, prompt, drafts)
    differ = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), None)
    if differ is None:
        assert spec_steps < NEW_TOKENS // 2
        return
    a, b = spec[differ], plain[differ]
    tie = _is_tie(plain_rows[differ], a, b, dtype) and _is_tie(spec_rows[differ], a, b, dtype)
    assert tie or _prefill_argmax(model, prompt + plain[:differ]) == a, (
        f"token {differ}: {a} speculated, {b} plain, logits {float(spec_rows[differ][a]):.4f}/"
        f"{float(spec_rows[differ][b]):.4f} and {float(plain_rows[differ][a]):.4f}/{float(plain_rows[differ][b]):.4f}")
