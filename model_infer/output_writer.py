"""OutputWriter: rank 0's output side of a step. It samples the step's logits, writes each new token,
its logprob and the finish status into the request's shm slot (in the pool's documented write
order), and tells the router (StepDone) and the detokenizer (TokensReady). Called by the worker loop
(process.py) after every forward.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from lightserve.messages import BatchPlan, FinishReason, StepDone, TokensReady, encode
from lightserve.model_config import ModelConfig
from lightserve.model_infer.grammar import GrammarSet
from lightserve.model_infer.logits_process import needs_processing, process_logits
from lightserve.model_infer.sampler import SamplingTensors, greedy_host, greedy_rows, sample, sampling_probs
from lightserve.model_infer.spec_verify import accept_greedy, accept_sampled, block_positions
from lightserve.model_infer.token_history import TokenHistory
from lightserve.shm.req_pool import ReqPool

# Prompt-logprob rows per log_softmax: 1024 x a 128k vocabulary is 512 MiB of float32 (ModelRunner reserves it).
PROMPT_LOGPROB_ROWS = 1024


class OutputWriter:
    """Rank 0: sample, publish tokens in shm, notify the router and the detokenizer."""

    def __init__(self, pool: ReqPool, model_config: ModelConfig, model_dir: str, to_router, to_detok,
                 device: torch.device | None = None, reasoning_parser: str | None = None):
        """`to_router`/`to_detok`: connected zmq PUSH sockets (anything with send/close in tests);
        `device`: where the logits live (the penalties' token history is kept there); `reasoning_parser`:
        --reasoning_parser, whose reasoning a request's grammar waits out (model_infer/grammar.py)."""
        self.pool = pool
        self.history = TokenHistory(pool.token_ids, device or torch.device("cpu"))
        self.eos_ids = np.array(model_config.eos_token_ids or [-1], np.int32)
        # req_id each slot was last seen with: a new id means a new occupant, whose counters reset.
        self.slot_req = np.full(pool.num_slots, -1, np.int64)
        self.to_router = to_router
        self.to_detok = to_detok
        self.grammars = GrammarSet(model_dir, model_config.vocab_size, reasoning_parser)

    def close(self) -> None:
        self.to_router.close(linger=0)
        self.to_detok.close(linger=0)

    def fill_pending_inputs(self, plan: BatchPlan) -> None:
        """Before the forward: the decode rows planned while the step that sampled their input token ran
        (BatchPlan.pending_inputs) take it from shm, where write() put it at the request's last position."""
        rows = plan.pending_inputs
        if rows.size:
            plan.input_ids[rows] = self.pool.token_ids[plan.shm_indices[rows], plan.prefix_lens[rows]]

    def argmax_only(self, plan: BatchPlan) -> bool:
        """Whether write() will read only each logits row's argmax: the step samples, every sampled row greedily,
        with no processing (penalties, bias, bans, grammar), no prompt logprobs, no top logprobs and its chosen
        logprob not reported (SamplingParams.report_logprobs). Asked before the forward (ModelRunner.forward)."""
        idx = plan.shm_indices[plan.sample]                      # [S] slots that sample this step
        if idx.size == 0 or plan.prompt_logit_idx.size:
            return False
        params = self.pool.params[idx]
        if params["report_logprobs"].any() or params["top_logprobs"].any() or params["grammar_kind"].any() \
                or not greedy_rows(params["temperature"], params["top_k"]).all():
            return False
        # A slot's first step after a new request took it has no outputs yet, whatever its counter still says.
        fresh = self.slot_req[idx] != plan.req_ids[plan.sample]
        num_out = np.where(fresh, 0, self.pool.num_output[idx]).astype(np.int64)
        return not needs_processing(params, num_out)

    def write(self, plan: BatchPlan, logits: torch.Tensor, forward_s: float) -> None:
        pool = self.pool
        fresh = self.slot_req[plan.shm_indices] != plan.req_ids
        if fresh.any():
            slots = plan.shm_indices[fresh]
            pool.num_output[slots] = 0
            pool.finish[slots] = FinishReason.NONE
            self.slot_req[slots] = plan.req_ids[fresh]
            self.grammars.drop(slots)
            self.history.reset(slots)
        rows = np.flatnonzero(plan.sample)                       # [S] plan rows that sample this step
        idx = plan.shm_indices[rows]                             # [S] their slots
        counts = 1 + plan.spec_lens[rows] if plan.spec_lens.size else None  # [S] logits rows of each, with drafts
        if plan.prompt_logit_idx.size:
            # Before any new token's count is published: a reader that sees the first output token
            # then sees every prompt logprob too.
            self._publish_prompt_logprobs(plan, logits[idx.size if counts is None else int(counts.sum()):])
        finish = np.zeros(plan.shm_indices.size, np.uint8)      # [B] reported to the router
        accepted = np.zeros(0, np.int32)
        spec_rows = rows[:0]                                     # plan rows that carried drafts
        if counts is not None:
            # Rows with drafts publish their bursts here; the others sample their one logits row below.
            accepted = np.zeros(plan.shm_indices.size, np.int32)
            first = np.cumsum(counts) - counts                   # [S] each row's first logits row
            drafting = counts > 1
            spec_rows = rows[drafting]
            finish[spec_rows], accepted[spec_rows] = self._verify_and_publish(plan, spec_rows, logits, first[drafting])
            rows, idx = rows[~drafting], idx[~drafting]
            logits = logits[torch.from_numpy(first[~drafting]).to(logits.device)]   # [S - R, vocab]
        # A request the step before finished (eos, a stop id) was planned before that was known (the router's
        # overlap schedule): its row is dropped, and its status reported again.
        ended = pool.finish[idx] != FinishReason.NONE
        if ended.any():
            finish[rows[ended]] = pool.finish[idx[ended]]
            live = np.flatnonzero(~ended)
            rows, idx, sampled = rows[live], idx[live], logits[: ended.size][torch.from_numpy(live)]
        else:
            sampled = logits[: idx.size]
        if idx.size:
            finish[rows] = self._sample_and_publish(idx, sampled)
        notify = np.concatenate([spec_rows, rows]) if spec_rows.size else rows   # plan rows with new tokens
        self.to_router.send(encode(StepDone(plan.step, forward_s, finish, time.monotonic(), accepted)), copy=False)
        if notify.size:
            self.to_detok.send(encode(TokensReady(plan.shm_indices[notify], plan.req_ids[notify])), copy=False)

    def _publish_prompt_logprobs(self, plan: BatchPlan, logits: torch.Tensor) -> None:
        """logits [E, vocab]: the distribution after each token of plan.prompt_logit_idx. Token t at
        sequence position p scores prompt token p + 1: its logprob goes to logprobs[slot, p + 1] and
        the slot's prompt_logprobs alternatives to top_ids/top_logprobs[slot, p + 1] (positions below
        prompt_len, so they never meet the output tokens' entries)."""
        pool = self.pool
        tok = plan.prompt_logit_idx.astype(np.int64)                              # [E] index in [T]
        q_start = np.cumsum(plan.extend_lens, dtype=np.int64) - plan.extend_lens  # [B]
        b = np.searchsorted(q_start, tok, side="right") - 1                       # [E] request of each
        slots = plan.shm_indices[b]
        target_pos = plan.prefix_lens[b] + (tok - q_start[b]) + 1                # [E]
        targets = torch.from_numpy(pool.token_ids[slots, target_pos].astype(np.int64)).to(logits.device)
        k = int(pool.params["prompt_logprobs"][slots].max())  # <= pool.max_top_logprobs (ReqPool.write_request)
        # PROMPT_LOGPROB_ROWS rows at a time, each chunk's results in shm before the next: a step's E rows (up to
        # --batch_max_tokens) never hold a [E, vocab] log_softmax beside the logits. Row by row the same numbers.
        for start in range(0, tok.size, PROMPT_LOGPROB_ROWS):
            part = slice(start, start + PROMPT_LOGPROB_ROWS)
            logp = torch.log_softmax(logits[part], dim=-1)                       # [n, vocab]
            pool.logprobs[slots[part], target_pos[part]] = logp.gather(1, targets[part, None])[:, 0].cpu().numpy()
            if k > 0:
                vals, ids = logp.topk(k, dim=-1)                                  # [n, k]
                pool.top_ids[slots[part], target_pos[part], :k] = ids.cpu().numpy().astype(np.int32)
                pool.top_logprobs[slots[part], target_pos[part], :k] = vals.cpu().numpy()
            del logp

    def _sample_and_publish(self, idx: np.ndarray, logits: torch.Tensor) -> np.ndarray:
        """Returns each row's FinishReason [S] uint8."""
        pool = self.pool
        params = pool.params[idx]                                # [S] structured copy
        num_out = pool.num_output[idx].astype(np.int64)          # [S]
        prompt_lens = pool.prompt_len[idx].astype(np.int64)      # [S]
        # Logprobs (chosen and top-N) are of the model's own distribution, before any processing:
        # processing works on a copy (and most steps, with no row to process, need none).
        raw = logits
        grammar_rows = np.flatnonzero(params["grammar_kind"] != 0)
        processed = bool(grammar_rows.size) or needs_processing(params, num_out)
        if processed:
            logits = process_logits(logits.clone(), idx, params, num_out, prompt_lens, self.history, self.eos_ids)
            if grammar_rows.size:
                self.grammars.mask(logits, idx, grammar_rows, params["grammar_kind"], pool)
        # An all-greedy batch on CPU needs no torch op (greedy_host); the rest goes through sample().
        host = None if processed else greedy_host(logits, params)
        if host is not None:
            next_ids = torch.from_numpy(host[0])
            ids, lps = host[0].astype(np.int32), host[1]
        else:
            # A row that reports no logprob (SamplingParams.report_logprobs) needs no logsumexp: with none, sample()
            # takes none and returns zeros (the rows with top logprobs get theirs below).
            next_ids, logprobs = sample(logits, SamplingTensors.from_params(params, num_out),
                                        raw_logits=None if logits is raw else raw,
                                        logprobs=bool(params["report_logprobs"].any()))
        pos = prompt_lens + num_out                              # where each new token goes
        self.history.append(idx, pos, next_ids)
        if host is None:
            ids, lps = _host_arrays(next_ids, logprobs)
        top_k = params["top_logprobs"]                           # <= pool.max_top_logprobs (ReqPool.write_request)
        top_rows = np.flatnonzero(top_k > 0)
        if top_rows.size:
            k = int(top_k.max())
            rows_t = torch.from_numpy(top_rows).to(raw.device)
            log_probs = torch.log_softmax(raw[rows_t], dim=-1)                                 # [R, V]
            top_vals, top_ids = log_probs.topk(k, dim=-1)                                       # [R, k]
            pool.top_ids[idx[top_rows], pos[top_rows], :k] = top_ids.cpu().numpy().astype(np.int32)
            pool.top_logprobs[idx[top_rows], pos[top_rows], :k] = top_vals.cpu().numpy()
            # The chosen token's logprob from the same numbers, so it equals its entry among the
            # alternatives (the sampler's logsumexp sums in another order: a few ulps apart).
            lps[top_rows] = log_probs.gather(1, next_ids[rows_t].unsqueeze(1)).squeeze(1).cpu().numpy()
        if grammar_rows.size:
            self.grammars.accept(idx[grammar_rows], ids[grammar_rows])
        new_count = (num_out + 1).astype(np.int32)
        finish = self._finish_reasons(params, ids, new_count, pos)
        # Write order (shm/req_pool.py): token and logprob, then the count, then the finish status.
        pool.token_ids[idx, pos] = ids
        pool.logprobs[idx, pos] = lps
        pool.num_output[idx] = new_count
        pool.finish[idx] = finish
        if grammar_rows.size:
            self.grammars.drop(idx[finish != FinishReason.NONE])
        return finish

    def _finish_reasons(self, params: np.ndarray, ids: np.ndarray, new_count: np.ndarray,
                        pos: np.ndarray) -> np.ndarray:
        """Each new token's FinishReason [N] uint8, vectorized: params [N] records, ids [N] the tokens, new_count [N]
        the output count with the token, pos [N] its position."""
        allow_stop = new_count >= params["min_new_tokens"]
        # A finished grammar (its matcher accepted eos) ends the request like eos does.
        # [S, E] compare, not np.isin: isin's general algorithm costs ~0.15 ms a step after a CPU forward.
        is_eos = ((ids[:, None] == self.eos_ids).any(axis=1)
                  & ((params["ignore_eos"] == 0) | (params["grammar_kind"] != 0)))
        stop_slots = np.arange(params["stop_token_ids"].shape[1]) < params["num_stop_token_ids"][:, None]
        is_stop_id = ((params["stop_token_ids"] == ids[:, None]) & stop_slots).any(axis=1)
        at_length = (new_count >= params["max_new_tokens"]) | (pos + 1 >= self.pool.max_len)
        return np.where(allow_stop & (is_eos | is_stop_id), FinishReason.STOP,
                        np.where(at_length, FinishReason.LENGTH, FinishReason.NONE)).astype(np.uint8)

    def _verify_and_publish(self, plan: BatchPlan, rows: np.ndarray, logits: torch.Tensor,
                            first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The plan rows `rows` [R] carried drafts (plan.spec_lens); their logits are logits[first[r] : first[r] + 1 +
        k_r]. Accept each row's leading drafts (spec_verify: accept_greedy for a greedy row, accept_sampled for a row
        that samples), then publish the burst: the accepted drafts and the token after them, cut at the first that
        ends the request (eos, a stop id, the length), in the pool's write order (tokens and logprobs, then
        num_output, then finish) so a reader sees the whole burst or none of it. Such rows are unprocessed
        (router/speculation.py admits no request with penalties, bias, allowed ids or a grammar, and none below its
        min_new_tokens). Returns (FinishReason [R] uint8, tokens published beyond the first [R] int32)."""
        pool = self.pool
        idx = plan.shm_indices[rows]                                             # [R] slots
        k = plan.spec_lens[rows].astype(np.int64)                                # [R] drafts each
        counts = 1 + k
        owner, within = block_positions(counts)                                  # [N] each position's row, offset
        block = logits[torch.from_numpy(np.repeat(first, counts) + within).to(logits.device)]   # [N, vocab]
        params = pool.params[idx]                                                # [R]
        num_out = pool.num_output[idx].astype(np.int64)                          # [R]
        q_start = np.cumsum(plan.extend_lens) - plan.extend_lens                 # [B]
        # A row's inputs are its last token then its drafts: drafts at q_start + 1 ..
        draft_owner, draft_within = block_positions(k)
        drafts = plan.input_ids[q_start[rows][draft_owner] + 1 + draft_within]   # [N - R]
        # targets [N]: each position's token where it is published (the accepted drafts, then the row's own token).
        targets = np.zeros(owner.size, np.int32)
        lps = np.zeros(owner.size, np.float32)
        accepted = np.zeros(rows.size, np.int32)
        sampling = ~greedy_rows(params["temperature"], params["top_k"])          # [R]
        for mask, verify in ((~sampling, _verify_greedy), (sampling, _verify_sampled)):
            if not mask.any():
                continue
            at = mask[owner]                                                     # [N] this kind's positions
            sub = block if mask.all() else block[torch.from_numpy(np.flatnonzero(at)).to(block.device)]
            targets[at], lps[at], accepted[mask] = verify(sub, params[mask], num_out[mask], drafts[mask[draft_owner]],
                                                          counts[mask])
        # The burst of each row: targets within its block up to accepted + 1, each token's finish status.
        in_burst = within <= accepted[owner]                                     # [N]
        pos = pool.prompt_len[idx][owner].astype(np.int64) + num_out[owner] + within   # [N] output positions
        new_count = (num_out[owner] + within + 1).astype(np.int32)
        reasons = self._finish_reasons(params[owner], targets, new_count, pos)  # [N]
        ends = (reasons != FinishReason.NONE) & in_burst
        # A burst ends at its first token that ends the request: the tokens after it are not published.
        publish = in_burst.copy()
        finish = np.zeros(rows.size, np.uint8)                                   # [R]
        for r, start in enumerate((np.cumsum(counts) - counts).tolist()):      # R <= a few dozen rows
            hit = np.flatnonzero(ends[start: start + int(counts[r])])
            if hit.size:
                publish[start + int(hit[0]) + 1: start + int(counts[r])] = False
                finish[r] = reasons[start + int(hit[0])]
        published = np.bincount(owner[publish], minlength=rows.size).astype(np.int32)   # [R]
        # Write order (shm/req_pool.py): tokens and logprobs, then the count, then the finish status.
        pool.token_ids[idx[owner[publish]], pos[publish]] = targets[publish]
        pool.logprobs[idx[owner[publish]], pos[publish]] = lps[publish]
        pool.num_output[idx] = (num_out + published).astype(np.int32)
        pool.finish[idx] = finish
        return finish, published - 1


def _verify_greedy(block: torch.Tensor, params: np.ndarray, num_out: np.ndarray, drafts: np.ndarray,
                   counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy rows of _verify_and_publish: block [N, vocab] their logits, params/num_out/counts [R], drafts [N - R].
    Returns (targets [N] int32, logprobs [N] float32, accepted [R] int32): every position's greedy token and its
    logprob, as a plain decode of it would choose and report them (greedy_host, else sample())."""
    owner, _ = block_positions(counts)
    host = greedy_host(block, params[owner])
    if host is not None:
        targets, lps = host[0].astype(np.int32), host[1]
    else:
        next_ids, logprobs = sample(block, SamplingTensors.from_params(params[owner], num_out[owner]),
                                    logprobs=bool(params["report_logprobs"].any()))
        targets, lps = _host_arrays(next_ids, logprobs)
    return targets, lps, accept_greedy(targets, drafts, counts)


def _verify_sampled(block: torch.Tensor, params: np.ndarray, num_out: np.ndarray, drafts: np.ndarray,
                    counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sampling rows of _verify_and_publish (the arguments and results of _verify_greedy): speculative sampling
    against each position's distribution as sample() would draw from it (spec_verify.accept_sampled). targets hold
    the drafts, then each row's drawn token at block start + accepted (positions after it are never published); a
    published token's logprob is what sample() reports, log_softmax of the model's logits at its position."""
    owner, within = block_positions(counts)
    steps = num_out[owner] + within                                          # [N] the output index each samples
    probs = sampling_probs(block, SamplingTensors.from_params(params[owner], steps))    # [N, vocab]
    accepted, tokens = accept_sampled(probs, drafts, counts, params["seed"], num_out)
    del probs
    targets = np.zeros(owner.size, np.int32)
    targets[within < (counts - 1)[owner]] = drafts
    targets[np.cumsum(counts) - counts + accepted] = tokens
    lps = np.zeros(owner.size, np.float32)
    if params["report_logprobs"].any():
        burst = torch.from_numpy(np.flatnonzero(within <= accepted[owner])).to(block.device)   # [P]
        rows = block[burst]                                                  # [P, vocab]
        chosen = rows.gather(1, torch.from_numpy(targets).to(block.device, torch.int64)[burst, None])[:, 0]
        lps[burst.cpu().numpy()] = (chosen - torch.logsumexp(rows, dim=-1)).cpu().numpy()
    return targets, lps, accepted


def _host_arrays(next_ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """sample()'s [S] ids and logprobs as numpy int32 and float32."""
    if next_ids.device.type != "cpu":
        # One read-back for both (the step's one wait for the GPU): ids < 2**53 are exact in float64.
        both = torch.stack([next_ids.to(torch.float64), logprobs.to(torch.float64)]).cpu().numpy()   # [2, S]
        return both[0].astype(np.int32), both[1].astype(np.float32)
    return next_ids.numpy().astype(np.int32), logprobs.numpy().astype(np.float32)  # host tensors: numpy views
