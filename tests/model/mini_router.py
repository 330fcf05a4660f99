"""MiniRouter: the router's side of a few requests for the worker-level speculative tests (tests/model/
test_draft_model.py, test_mtp.py): plans as the router makes them, run by a real ModelRunner, accepted greedily as
rank 0 does."""
from __future__ import annotations

import numpy as np
import torch

from lightserve.messages import BatchPlan
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.spec_verify import accept_greedy

from .fake_worker import FakeWorker

MAX_LEN = 96  # the runner's max_req_total_len
PROMPTS = ([5, 9, 14, 3, 77, 21, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7, 7, 101])


def mixed_drafts(request: int, step: int) -> int:
    """Drafts per request and step: request 0 drafts 3 each step, request 1 alternates 4 and a plain decode, request 2
    drafts 1, 2, 3 in turn."""
    return [3, 4 * (step % 2), 1 + step % 3][request]


def greedy(model, prompt: list[int], num_new: int) -> list[int]:
    """The model's greedy continuation of `prompt`, alone in a fresh cache: one prefill, then decodes."""
    worker = FakeWorker(model, num_kv_rows=MAX_LEN + 2, num_req_rows=1, max_len=MAX_LEN)
    out = []
    with torch.inference_mode():
        logits = worker.step([(0, list(prompt))], num_decode=0)
        for _ in range(num_new):
            out.append(int(logits[0].argmax()))
            if len(out) < num_new:
                logits = worker.step([(0, [out[-1]])], num_decode=1)
    return out


class MiniRouter:
    """The router's side of a few requests: KV rows from a free list (a freed row is the next one handed out),
    request r on req_to_token row r, a step of plain decodes, then speculating rows (k placeholders each), then
    prompt chunks; greedy acceptance as rank 0 does it."""

    def __init__(self, runner: ModelRunner, prompts: tuple[list[int], ...], chunk: int = 5):
        self.runner = runner
        self.free = list(range(runner.kv_size))
        self.seqs = [list(p) for p in prompts]
        self.prompt_lens = [len(p) for p in prompts]
        self.locs: list[list[int]] = [[] for _ in prompts]        # KV row of each computed token
        self.chunk = chunk
        self.proposals: list[tuple[int, list[int], list[int]]] = []   # (request, its tokens, the drafts proposed)
        self.drafted = self.accepted = self.steps = 0

    def alloc(self, n: int) -> list[int]:
        rows, self.free = self.free[:n], self.free[n:]
        return rows

    def run(self, steps: int, k_of=mixed_drafts) -> MiniRouter:
        """`steps` steps, request r drafting k_of(r, step) tokens in each."""
        for s in range(steps):
            self.step(lambda r, s=s: k_of(r, s))
        return self

    def step(self, k_of) -> None:
        """One step: a request whose prompt is not all computed takes a chunk; the others decode, speculating with
        k_of(r) drafts (0: a plain decode)."""
        decodes, spec, chunks = [], [], []
        for r, seq in enumerate(self.seqs):
            done = len(self.locs[r])
            if done < self.prompt_lens[r]:
                chunks.append((r, seq[done: done + self.chunk]))
            elif k_of(r) == 0:
                decodes.append((r, seq[done:]))
            else:
                spec.append((r, seq[done:] + [0] * k_of(r)))
        rows = decodes + spec + chunks
        locs = [self.alloc(len(ids)) for _, ids in rows]
        ends = [len(self.locs[r]) + len(ids) for r, ids in rows]
        plan = BatchPlan(step=self.steps, shm_indices=np.array([r for r, _ in rows], np.int32),
                         req_ids=np.array([r for r, _ in rows], np.int64),
                         prefix_lens=np.array([len(self.locs[r]) for r, _ in rows], np.int32),
                         extend_lens=np.array([len(ids) for _, ids in rows], np.int32),
                         sample=np.array([len(self.locs[r]) + len(ids) >= self.prompt_lens[r]
                                          for (r, ids) in rows]),
                         input_ids=np.array([t for _, ids in rows for t in ids], np.int32),
                         kv_locs=np.array([x for row in locs for x in row], np.int32), num_decode=len(decodes),
                         spec_lens=np.array([0] * len(decodes) + [len(ids) - 1 for _, ids in spec] +
                                            [0] * len(chunks), np.int32))
        assert max(ends) <= MAX_LEN
        logits = self.runner.forward(plan)
        targets = logits.argmax(-1).numpy()
        q, at = 0, 0                              # token offset in the plan, logits row
        for i, ((r, ids), row_locs) in enumerate(zip(rows, locs)):
            n = len(ids)
            if len(decodes) <= i < len(decodes) + len(spec):
                drafts = plan.input_ids[q + 1: q + n].tolist()
                self.proposals.append((r, list(self.seqs[r]), drafts))
                accepted = int(accept_greedy(targets[at: at + n], np.array(drafts, np.int64), np.array([n]))[0])
                self.drafted += n - 1
                self.accepted += accepted
                self.locs[r] += row_locs[: 1 + accepted]
                self.free = row_locs[1 + accepted:] + self.free   # reused first: another token's row next step
                self.seqs[r] += drafts[:accepted] + [int(targets[at + accepted])]
                at += n
            else:
                self.locs[r] += row_locs
                if plan.sample[i]:
                    self.seqs[r].append(int(targets[at]))
                    at += 1
            q += n
        self.steps += 1
