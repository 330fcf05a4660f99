"""Per-request logit processing before sampling, batched: penalties, logit_bias, allowed token ids,
and the eos/stop-id ban below min_new_tokens. Called by the worker's OutputWriter (rank 0) with a
batch's params gathered from shm; every function works on the rows that need it, with no
per-request Python loop.

Penalty semantics follow vLLM: repetition_penalty (HF style: positive logits divided, negative
multiplied) applies to every token seen in the prompt or the output; presence and frequency
penalties (OpenAI style) apply to output tokens only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from lightserve.model_infer.token_history import TokenHistory

NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, history: torch.Tensor, seq_lens: torch.Tensor,
                    prompt_lens: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> None:
    """In place on logits [S, V] at `rows` [R].

    history [R, L] int64: each row's tokens (prompt then outputs), valid below seq_lens [R] (>= 1);
    prompt_lens [R]; repetition, presence, frequency [R] float32.
    NOTE: the penalties are rebuilt from the token history every step (no per-slot counts that
    pause/resume or slot reuse could get wrong; the history itself stays on the device, see
    TokenHistory), and they touch only the [R, L] history positions of
    the flattened logits (gather, index_put, index_add), never a dense [R, V] count matrix: measured
    here at R=64, L=1024, V=49152, a dense scatter_add + where cost ~15x a softmax of the batch, this
    ~3x, both noisy on the shared CPU (scripts/bench_penalties.py).
    """
    vocab = logits.shape[1]
    flat = logits.view(-1)
    pos = torch.arange(history.shape[1], device=logits.device).unsqueeze(0)  # [1, L]
    valid = pos < seq_lens.unsqueeze(1)                                     # [R, L]
    is_output = valid & (pos >= prompt_lens.unsqueeze(1))                   # [R, L]
    base = rows.unsqueeze(1) * vocab                                        # [R, 1]
    # Padding repeats the row's first token: it writes the same value that token's real entry does.
    ids = torch.where(valid, history, history[:, :1])                       # [R, L]
    idx = base + ids                                                        # [R, L] into flat
    vals = flat[idx]
    rep = repetition.unsqueeze(1)
    flat[idx] = torch.where(vals > 0, vals / rep, vals * rep)               # duplicates write equal values
    # frequency: once per output occurrence
    freq = torch.where(is_output, frequency.unsqueeze(1), 0.0).to(flat.dtype)
    flat.index_add_(0, idx.flatten(), -freq.flatten())
    # presence: once per distinct output token (sorted, first of each run)
    key, _ = torch.where(is_output, history, vocab).sort(dim=1)             # [R, L] padding sorts last
    first = torch.ones_like(key, dtype=torch.bool)
    first[:, 1:] = key[:, 1:] != key[:, :-1]
    use = first & (key < vocab)
    pres = torch.where(use, presence.unsqueeze(1), 0.0).to(flat.dtype)
    flat.index_add_(0, (base + torch.where(use, key, 0)).flatten(), -pres.flatten())


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, values: torch.Tensor,
                     counts: torch.Tensor) -> None:
    """In place: logits[rows[r], ids[r, j]] += values[r, j] for j < counts[r]. ids [R, M] int64."""
    used = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < counts.unsqueeze(1)  # [R, M]
    sub = logits[rows]
    sub.scatter_add_(1, torch.where(used, ids, 0), torch.where(used, values, 0.0).to(sub.dtype))
    logits[rows] = sub


def mask_to_allowed(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> None:
    """In place: every token of row rows[r] outside ids[r, :counts[r]] gets -inf. counts >= 1."""
    used = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < counts.unsqueeze(1)  # [R, M]
    keep_ids = torch.where(used, ids, ids[:, :1])                              # padding repeats the first id
    banned = torch.ones(rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    banned.scatter_(1, keep_ids, False)
    logits[rows] = logits[rows].masked_fill(banned, NEG_INF)


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, used: torch.Tensor) -> None:
    """In place: logits[rows[r], ids[r, j]] = -inf where used[r, j]. ids [R, M] int64, used [R, M] bool."""
    vocab = logits.shape[1]
    banned = torch.zeros(rows.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    banned.scatter_(1, torch.where(used, ids, vocab), True)
    logits[rows] = logits[rows].masked_fill(banned[:, :vocab], NEG_INF)


def _rows_asking(params: np.ndarray, num_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """[S] bool masks of the rows each processing asks for, in process_logits' order: the eos/stop ban
    below min_new_tokens, logit_bias, allowed_token_ids, the penalties."""
    return (num_out < params["min_new_tokens"], params["num_logit_bias"] > 0, params["num_allowed_token_ids"] > 0,
            (params["repetition_penalty"] != 1.0) | (params["presence_penalty"] != 0.0)
            | (params["frequency_penalty"] != 0.0))


def needs_processing(params: np.ndarray, num_out: np.ndarray) -> bool:
    """Whether process_logits would change any row (params [S] PARAMS_DTYPE records, num_out [S]):
    when not, the caller samples from the model's logits as they are, with no copy."""
    return any(bool(mask.any()) for mask in _rows_asking(params, num_out))


def process_logits(logits: torch.Tensor, slots: np.ndarray, params: np.ndarray, num_out: np.ndarray,
                   prompt_lens: np.ndarray, history: TokenHistory, eos_ids: np.ndarray) -> torch.Tensor:
    """Everything above for one batch, each step only on the rows that ask for it.

    logits [S, V] float32 (modified in place and returned); slots [S] the rows' shm_index; params [S]
    PARAMS_DTYPE records; num_out, prompt_lens [S] (outputs already published, prompt length);
    history: every slot's tokens, read only at the penalized rows; eos_ids [E] int32.
    """
    dev = logits.device

    def rows_of(mask: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        sel = np.flatnonzero(mask)
        return sel, torch.from_numpy(sel).to(dev, non_blocking=True)

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype, non_blocking=True)

    ban, bias, allowed, penalized = _rows_asking(params, num_out)
    # Below min_new_tokens, eos and the stop ids cannot be sampled (not merely ignored).
    sel, rows = rows_of(ban)
    if sel.size:
        stop_ids = params["stop_token_ids"][sel]                                     # [R, 16]
        stop_used = np.arange(stop_ids.shape[1]) < params["num_stop_token_ids"][sel, None]
        ids = np.concatenate([np.broadcast_to(eos_ids, (sel.size, eos_ids.size)), stop_ids], axis=1)
        used = np.concatenate([np.broadcast_to(eos_ids >= 0, (sel.size, eos_ids.size)), stop_used], axis=1)
        ban_tokens(logits, rows, t(np.maximum(ids, 0), torch.int64), t(used, torch.bool))
    sel, rows = rows_of(bias)
    if sel.size:
        apply_logit_bias(logits, rows, t(params["logit_bias_ids"][sel], torch.int64),
                         t(params["logit_bias_values"][sel], torch.float32), t(params["num_logit_bias"][sel],
                                                                               torch.int64))
    sel, rows = rows_of(allowed)
    if sel.size:
        mask_to_allowed(logits, rows, t(params["allowed_token_ids"][sel], torch.int64),
                        t(params["num_allowed_token_ids"][sel], torch.int64))
    sel, rows = rows_of(penalized)
    if sel.size:
        seq_lens = prompt_lens[sel] + num_out[sel]                                   # [R]
        tokens = history.gather(slots[sel], seq_lens)                                # [R, L] int64 on dev
        apply_penalties(logits, rows, tokens, t(seq_lens, torch.int64),
                        t(prompt_lens[sel], torch.int64), t(params["repetition_penalty"][sel], torch.float32),
                        t(params["presence_penalty"][sel], torch.float32),
                        t(params["frequency_penalty"][sel], torch.float32))
    return logits
