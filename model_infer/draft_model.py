"""DraftModel: --speculative_algorithm draft on a worker rank. A smaller model of the served model's tokenizer
proposes each speculating request's draft tokens, greedily, right before the served model scores them.

The router plans a speculating request as for ngram (router/speculation.py): an extend row of its last sampled token
and k draft positions, each with a KV row of its own, the draft tokens left as placeholders. `propose` fills them in
place in the plan's input_ids, on every rank alike, so rank 0's verification reads them from there as it reads
ngram's.

The draft's KV cache is a second cache of the same number of rows, indexed by the same KV rows the router allocates:
the draft runs over every token the served model computes (prompt chunks, plain decodes, a speculating request's
last token and every one of its drafts), so a row is valid in the draft's cache exactly when it is in the served
model's, whether it came from this request, a prefix-cache hit or a resume. A rejected draft's row is freed by the
router for both caches at once. Per step with speculating rows of up to K drafts, the draft runs K + 1 forwards:

    1. the plan as it is, each speculating row cut to its last sampled token -> every such row's first draft d1;
    2..K. one decode per row still drafting: d_{j-1} at its row -> d_j;
    K+1. d_K at its row, logits unread, so that the row holds draft KV if the served model accepts d_K.

Drafts are the draft model's argmax: a deterministic proposal, so a sampling request's speculative sampling
(spec_verify.accept_sampled, which treats a draft as a point mass) leaves its output distribution unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.messages import BatchPlan
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging

if TYPE_CHECKING:
    from lightserve.model_infer.models.base import DecoderLM


class DraftModel:
    wants_hidden = False  # the draft reads tokens only (MtpDrafter reads the served model's states)

    def __init__(self, model: DecoderLM, num_kv_rows: int, num_req_rows: int, max_req_total_len: int):
        """`model`: the draft, loaded on this rank's device and TP shard. Its cache: `num_kv_rows` rows, the served
        model cache's count (the router's range and the scratch row), and its own req_to_token table."""
        self.model = model
        self.kv_cache = model.make_kv_cache(num_kv_rows, num_req_rows, max_req_total_len)
        self.staging = HostStaging(model.device)

    @torch.inference_mode()
    def propose(self, plan: BatchPlan) -> None:
        """Run the draft over the plan's tokens (writing its KV where the served model will write its own) and, for
        each speculating row (plan.spec_lens > 0), write its k draft tokens into plan.input_ids after its last
        sampled token."""
        extend = plan.extend_lens
        q_start = np.cumsum(extend, dtype=np.int32) - extend                     # [B]
        spec = np.flatnonzero(plan.spec_lens) if plan.spec_lens.size else np.zeros(0, np.int64)   # [R] plan rows
        first = self._forward(self._first_plan(plan, spec, q_start))            # [R] d1 of each speculating row
        if not spec.size:
            return
        k = plan.spec_lens[spec]                                                 # [R] drafts per row
        starts = q_start[spec]                                                   # [R] its last token's index in [T]
        plan.input_ids[starts + 1] = first
        for j in range(1, int(k.max()) + 1):
            # Rows still drafting write d_j's KV (input position j of their extend); those with k > j read d_{j+1}.
            live = k >= j                                                        # [R]
            rows, at = spec[live], starts[live] + j
            step = BatchPlan(step=plan.step, shm_indices=plan.shm_indices[rows], req_ids=plan.req_ids[rows],
                             prefix_lens=plan.prefix_lens[rows] + j, extend_lens=np.ones(rows.size, np.int32),
                             sample=k[live] > j, input_ids=plan.input_ids[at], kv_locs=plan.kv_locs[at],
                             num_decode=int(rows.size))
            drafts = self._forward(step)
            if drafts.size:
                plan.input_ids[at[step.sample] + 1] = drafts

    def _first_plan(self, plan: BatchPlan, spec: np.ndarray, q_start: np.ndarray) -> BatchPlan:
        """The plan's requests and tokens, each speculating row cut to its first token (its last sampled one) and
        the only rows sampled; no prompt logprobs, no LoRA (the draft serves none)."""
        extend = plan.extend_lens.copy()
        extend[spec] = 1
        keep = np.ones(plan.input_ids.size, bool)                                # [T] tokens the draft computes
        for row in spec:
            keep[q_start[row] + 1: q_start[row] + plan.extend_lens[row]] = False
        sample = np.zeros(extend.size, bool)
        sample[spec] = True
        return BatchPlan(step=plan.step, shm_indices=plan.shm_indices, req_ids=plan.req_ids,
                         prefix_lens=plan.prefix_lens, extend_lens=extend, sample=sample,
                         input_ids=plan.input_ids[keep], kv_locs=plan.kv_locs[keep], num_decode=plan.num_decode,
                         fill_rows=plan.fill_rows, fill_pos=plan.fill_pos, fill_locs=plan.fill_locs)

    def _forward(self, plan: BatchPlan) -> np.ndarray:
        """One draft forward; [S] int32, the argmax of each sampled row (empty: none sampled)."""
        batch = make_forward_batch(plan, self.kv_cache.req_to_token, self.staging, argmax_only=True)
        logits = self.model.forward(batch, self.kv_cache)                        # [S, vocab] (bf16 kept)
        return logits.argmax(dim=-1).to(torch.int32).cpu().numpy()

    def keep(self, plan: BatchPlan, hidden: torch.Tensor) -> None:
        """Nothing to keep from the served model's forward (wants_hidden is False)."""
