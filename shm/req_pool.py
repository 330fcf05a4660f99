"""ReqPool: the shared-memory request pool, one fixed-size slot per in-flight request.

Every field has exactly one writer process (named beside it). A slot (`shm_index`) is reused only
when the HTTP front, the router and the detokenizer have each released the current occupant:
`released_gen[owner, i] == slot_gen[i]` for all three owners.

Field                      writer          notes
slot_gen     u32 [N]        front           bumped when the front takes the slot (start of a request)
req_id       i64 [N]        front           unique per request; messages carry it to detect reuse
prompt_len   i32 [N]        front
params       PARAMS [N]     front           SamplingParams' numeric fields (lightserve.sampling), with fixed-size
                                           lists: logit_bias_ids/values, allowed_token_ids (64 each),
                                           stop_token_ids (16); grammar_kind; group_id (n samples)
stop_len     i32 [N]        front           bytes of stop_json in use
stop_json    u8 [N, S]      front           UTF-8 JSON list of stop strings
token_ids    i32 [N, L]     front [0, prompt_len); rank 0 [prompt_len, prompt_len + num_output)
logprobs     f32 [N, L]     rank 0          logprob of output token j at [prompt_len + j]; with
                                           params.prompt_logprobs, of prompt token p at [p] (p >= 1)
top_ids      i32 [N, L, K]  rank 0          top-K alternatives of the token at the same position
top_logprobs f32 [N, L, K]  rank 0          their logprobs; only the first params.top_logprobs are set
grammar_len  i32 [N]        front           bytes of grammar in use (0: unconstrained)
grammar      u8 [N, G]      front           grammar text (JSON schema / regex / EBNF; params.grammar_kind)
num_output   i32 [N]        rank 0          published AFTER the token and logprob it counts
finish       u8 [N]         rank 0          FinishReason; written AFTER num_output is final
cached_len   i32 [N]        router          prompt tokens served from the prefix cache
released_gen u32 [3, N]     row FRONT: front, row ROUTER: router, row DETOK: detokenizer
stats        i64 [K]        router          counters for /metrics (STATS_FIELDS)

K = --max_top_logprobs (default 5; 0 leaves the arrays empty). NOTE: sized per position like
logprobs, not as a ring of the latest token: a ring would be overwritten whenever the detokenizer
lags rank 0 by more than its length, and there is no backpressure between them. The cost is
N x L x K x 8 bytes of address space (512 x 8192 x 5 x 8 = 168 MB by default), but tmpfs backs
only the pages written, i.e. the positions of requests that asked for top logprobs.

Write order for each new token (rank 0): token_ids, logprobs (and top_*), num_output, then finish. A reader
that reads finish first and num_output second therefore never sees a count ahead of its tokens,
and once it sees a finish status the count it reads next is final.
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from lightserve.sampling import MAX_GRAMMAR_BYTES, MAX_STOP_STR_BYTES, PARAMS_DTYPE
from lightserve.shm.segment import Segment


class Owner(IntEnum):
    FRONT = 0
    ROUTER = 1
    DETOK = 2


# Draft positions with an acceptance counter: config.MAX_SPECULATIVE_TOKENS (tests/router/test_speculation.py checks).
SPEC_POSITIONS = 16

STATS_FIELDS = (
    "kv_tokens_total", "kv_tokens_free", "kv_tokens_cached",
    "requests_running", "requests_waiting", "requests_paused",
    "pauses_total", "resumes_total",
    "prompt_tokens_total", "prompt_tokens_cached_total", "generation_tokens_total",
    "steps_total", "max_batch_size", "last_batch_size",
    # Speculative decoding (router/speculation.py): requests' steps with drafts, their draft tokens, those
    # accepted, and per draft position the drafts accepted there.
    "spec_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
    *(f"spec_accepted_pos_{i}" for i in range(SPEC_POSITIONS)),
)

_HEADER = np.dtype([("num_slots", np.int64), ("max_len", np.int64), ("max_top_logprobs", np.int64)])


def _layout(num_slots: int, max_len: int, top_k: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    n, length = num_slots, max_len
    return [
        ("slot_gen", np.dtype(np.uint32), (n,)),
        ("req_id", np.dtype(np.int64), (n,)),
        ("prompt_len", np.dtype(np.int32), (n,)),
        ("params", PARAMS_DTYPE, (n,)),
        ("stop_len", np.dtype(np.int32), (n,)),
        ("stop_json", np.dtype(np.uint8), (n, MAX_STOP_STR_BYTES)),
        ("token_ids", np.dtype(np.int32), (n, length)),
        ("logprobs", np.dtype(np.float32), (n, length)),
        ("top_ids", np.dtype(np.int32), (n, length, top_k)),
        ("top_logprobs", np.dtype(np.float32), (n, length, top_k)),
        ("grammar_len", np.dtype(np.int32), (n,)),
        ("grammar", np.dtype(np.uint8), (n, MAX_GRAMMAR_BYTES)),
        ("num_output", np.dtype(np.int32), (n,)),
        ("finish", np.dtype(np.uint8), (n,)),
        ("cached_len", np.dtype(np.int32), (n,)),
        ("released_gen", np.dtype(np.uint32), (len(Owner), n)),
        ("stats", np.dtype(np.int64), (len(STATS_FIELDS),)),
    ]


def _offsets(num_slots: int, max_len: int, top_k: int) -> tuple[dict[str, int], int]:
    offsets, pos = {}, 64  # header first, every array 64-byte aligned (own cache lines)
    for name, dtype, shape in _layout(num_slots, max_len, top_k):
        offsets[name] = pos
        pos += -(-dtype.itemsize * int(np.prod(shape)) // 64) * 64
    return offsets, pos


class ReqPool:
    """numpy views over one segment. Create in the launcher; attach in every other process."""

    def __init__(self, segment: Segment):
        self.segment = segment
        header = np.frombuffer(segment.buf, _HEADER, count=1)[0]
        self.num_slots, self.max_len = int(header["num_slots"]), int(header["max_len"])
        self.max_top_logprobs = int(header["max_top_logprobs"])
        offsets, _ = _offsets(self.num_slots, self.max_len, self.max_top_logprobs)
        for name, dtype, shape in _layout(self.num_slots, self.max_len, self.max_top_logprobs):
            count = int(np.prod(shape))
            view = np.frombuffer(segment.buf, dtype, count=count, offset=offsets[name]).reshape(shape)
            setattr(self, name, view)

    @classmethod
    def create(cls, name: str, num_slots: int, max_len: int, max_top_logprobs: int = 5) -> ReqPool:
        _, size = _offsets(num_slots, max_len, max_top_logprobs)
        segment = Segment.create(name, size)
        header = np.frombuffer(segment.buf, _HEADER, count=1)
        header["num_slots"], header["max_len"] = num_slots, max_len
        header["max_top_logprobs"] = max_top_logprobs
        del header
        return cls(segment)

    @staticmethod
    def size_bytes(num_slots: int, max_len: int, max_top_logprobs: int = 5) -> int:
        """Bytes of the segment `create` would make (sparse: pages are backed only where written)."""
        return _offsets(num_slots, max_len, max_top_logprobs)[1]

    @classmethod
    def attach(cls, name: str) -> ReqPool:
        return cls(Segment.attach(name))

    def close(self) -> None:
        for name, _, _ in _layout(self.num_slots, self.max_len, self.max_top_logprobs):
            self.__dict__.pop(name, None)
        self.segment.close()

    # ---- slot ownership ----------------------------------------------------------------------
    def free_slots(self) -> np.ndarray:
        """Slots every owner has released. Vectorized over the pool: microseconds for 1k slots."""
        return np.flatnonzero((self.released_gen == self.slot_gen).all(axis=0))

    def num_free_slots(self) -> int:
        return int((self.released_gen == self.slot_gen).all(axis=0).sum())

    def acquire(self, shm_index: int, req_id: int) -> None:
        """Front: take a free slot for a new request (before writing its fields)."""
        assert (self.released_gen[:, shm_index] == self.slot_gen[shm_index]).all(), f"slot {shm_index} in use"
        self.slot_gen[shm_index] += 1
        self.req_id[shm_index] = req_id

    def release(self, owner: Owner, shm_index: int) -> None:
        self.released_gen[owner, shm_index] = self.slot_gen[shm_index]

    # ---- front: request fields ------------------------------------------------------------------
    def write_request(self, shm_index: int, prompt_ids: list[int] | np.ndarray, params, seed: int) -> None:
        """Front: prompt tokens and sampling params. `params` is a SamplingParams that EngineClient.check_prompt passed
        (so its alternatives fit the pool's max_top_logprobs: rank 0 and the readers take them as they are); `seed`
        resolved."""
        n = len(prompt_ids)
        assert 0 < n < self.max_len, n
        assert max(params.top_logprobs, params.prompt_logprobs or 0) <= self.max_top_logprobs, params
        self.token_ids[shm_index, :n] = prompt_ids
        self.prompt_len[shm_index] = n
        record = self.params[shm_index:shm_index + 1].reshape(())
        params.to_record(record)
        record["seed"] = seed
        stop = params.stop_bytes()
        self.stop_json[shm_index, : len(stop)] = np.frombuffer(stop, np.uint8)
        self.stop_len[shm_index] = len(stop)
        grammar = params.grammar.encode()
        self.grammar[shm_index, : len(grammar)] = np.frombuffer(grammar, np.uint8)
        self.grammar_len[shm_index] = len(grammar)

    def stop_strings(self, shm_index: int) -> list[str]:
        import json
        n = int(self.stop_len[shm_index])
        return json.loads(self.stop_json[shm_index, :n].tobytes()) if n else []

    def grammar_text(self, shm_index: int) -> str:
        n = int(self.grammar_len[shm_index])
        return self.grammar[shm_index, :n].tobytes().decode()

    # ---- rank 0: outputs ---------------------------------------------------------------------------
    def read_output(self, shm_index: int) -> tuple[int, int]:
        """(finish, num_output) in the safe order: finish first (see module docstring)."""
        finish = int(self.finish[shm_index])
        return finish, int(self.num_output[shm_index])

    def output_ids(self, shm_index: int, start: int, end: int) -> np.ndarray:
        base = int(self.prompt_len[shm_index])
        return self.token_ids[shm_index, base + start: base + end]

    def output_logprobs(self, shm_index: int, start: int, end: int) -> np.ndarray:
        base = int(self.prompt_len[shm_index])
        return self.logprobs[shm_index, base + start: base + end]

    def output_top_logprobs(self, shm_index: int, start: int, end: int) -> list[list[tuple[int, float]]]:
        """Per output token in [start, end): its params.top_logprobs alternatives, best first."""
        k = int(self.params[shm_index]["top_logprobs"])
        if k == 0:
            return []
        base = int(self.prompt_len[shm_index])
        ids = self.top_ids[shm_index, base + start: base + end, :k].tolist()
        lps = self.top_logprobs[shm_index, base + start: base + end, :k].tolist()
        return [list(zip(i, v)) for i, v in zip(ids, lps)]

    def prompt_logprobs(self, shm_index: int) -> tuple[list[float], list[list[tuple[int, float]]]] | None:
        """Logprobs of prompt tokens 1..prompt_len-1 and their params.prompt_logprobs alternatives, or
        None when the request asked for none. Valid once its first output token is published."""
        k = int(self.params[shm_index]["prompt_logprobs"])
        if k < 0:
            return None
        n = int(self.prompt_len[shm_index])
        lps = self.logprobs[shm_index, 1:n].tolist()
        if k == 0:
            return lps, [[] for _ in lps]
        ids = self.top_ids[shm_index, 1:n, :k].tolist()
        vals = self.top_logprobs[shm_index, 1:n, :k].tolist()
        return lps, [list(zip(i, v)) for i, v in zip(ids, vals)]

    # ---- router: stats ---------------------------------------------------------------------------------
    def set_stat(self, name: str, value: int) -> None:
        self.stats[STATS_FIELDS.index(name)] = value

    def stats_dict(self) -> dict[str, int]:
        return dict(zip(STATS_FIELDS, (int(v) for v in self.stats)))
