"""Every zmq message between lightserve processes, as small frozen dataclasses.

Messages carry shared-memory slot indices (`shm_index`) and small control data, never prompt or
output tokens: those live in the request pool (shm/). `encode`/`decode` are the one wire format
(pickle protocol 5); receivers dispatch with `match msg:` on the type.
"""
from __future__ import annotations

import operator
import pickle
from dataclasses import dataclass, field, fields
from enum import IntEnum

import numpy as np


def message(cls):
    """A message class: a frozen dataclass with slots that pickles as a call of its constructor with its field
    values. dataclasses pickle a slotted class through fields() for every object: a step's DeltaBatch of 64
    ReqDeltas took 165-172 us to pickle and 204-223 to unpickle that way, 51-59 and 111-119 this way (Zen 4)."""
    cls = dataclass(frozen=True, slots=True)(cls)
    names = tuple(f.name for f in fields(cls))
    if len(names) > 1:
        values = operator.attrgetter(*names)  # -> a tuple, in C
    else:  # attrgetter of one name returns the bare value, and of none is an error
        def values(obj):
            return tuple(getattr(obj, name) for name in names)

    def __reduce__(self):
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


class FinishReason(IntEnum):
    """Stored as a u8 in the request slot; NONE while the request runs."""
    NONE = 0
    STOP = 1     # eos, a stop token id or a stop string
    LENGTH = 2   # max_new_tokens or the context length
    ABORT = 3    # client gone, timeout, or server error

    def api_name(self) -> str | None:
        return None if self is FinishReason.NONE else self.name.lower()


# ---- HTTP front -> router ------------------------------------------------------------------
@message
class AddReq:
    """A request whose slot is fully written; the router may schedule it."""
    shm_index: int
    req_id: int


@message
class AbortReq:
    """Stop a request now (client disconnect, timeout, stop string seen by the detokenizer)."""
    shm_index: int
    req_id: int
    reason: FinishReason = FinishReason.ABORT


@message
class LoraAdded:
    """A LoRA adapter the front serves from now on (POST /v1/load_lora_adapter): requests may name `lora_id`."""
    lora_id: int
    path: str


@message
class LoraRemoved:
    """The front no longer serves adapter `lora_id` (no request of it is left)."""
    lora_id: int


# ---- router -> every worker rank -------------------------------------------------------------
@message
class BatchPlan:
    """One forward step. Identical bytes go to every tensor-parallel rank.

    Requests [0, num_decode) decode one token; the rest extend (prefill, possibly a chunk).
    """
    step: int
    shm_indices: np.ndarray      # [B] int32, request slot (also the worker's req_to_token row)
    req_ids: np.ndarray          # [B] int64, to detect a reused slot
    prefix_lens: np.ndarray      # [B] int32, tokens already in KV before this step
    extend_lens: np.ndarray      # [B] int32, tokens computed this step
    sample: np.ndarray           # [B] bool, False for a prefill chunk that is not the last
    input_ids: np.ndarray        # [T] int32, the new tokens back to back
    kv_locs: np.ndarray          # [T] int32, KV rows the new tokens are written to
    num_decode: int
    # Cached-prefix KV rows to copy into req_to_token before the step (prefix-cache hits, resumes):
    fill_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))   # [F] request slot
    fill_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))    # [F] token position
    fill_locs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))   # [F] KV row
    # Extra logits rows for prompt logprobs: indices into [T] of prompt tokens whose next-token
    # distribution rank 0 needs (requests with prompt_logprobs). Logits come back [S + E, vocab].
    prompt_logit_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))   # [E]
    # Decode rows (indices into [0, num_decode)) planned while the step that samples their input token was still
    # running (the router's overlap schedule): input_ids holds -1 there, and rank 0, which wrote that token,
    # fills it in from shm token_ids[slot, prefix_len] before the forward. Only with tp 1.
    pending_inputs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))     # [P]
    # Speculative decoding: draft tokens each request carries (0: none; empty: no request speculates). A
    # speculating request is an extend row of 1 + k tokens (its last sampled token, then the k draft tokens), and
    # it gets logits at every one of them: logits come back [sum over sampled rows of (1 + k), vocab], each row's
    # block in plan order, then the E prompt-logprob rows. Rank 0 verifies the drafts (StepDone.num_accepted).
    spec_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))          # [B]
    # LoRA: each request's slot in the workers' stacked adapter weights (-1: the base model; empty: no request runs
    # an adapter). The router sends LoadLora for a slot before the first plan that names it.
    lora_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))         # [B]


@message
class LoadLora:
    """Router -> workers: put adapter `lora_id` (PEFT files in `path`) into slot `slot` of the stacked LoRA weights,
    replacing whatever the slot held, before the next plan; from the rank's CPU cache of adapters if it is there."""
    lora_id: int
    path: str
    slot: int


@message
class PrefetchLora:
    """Router -> workers: a request waits for adapter `lora_id`, which no slot holds: read it from `path` into the
    rank's CPU cache in the background, so the LoadLora that follows copies it between two steps instead of reading
    the disk there."""
    lora_id: int
    path: str


@message
class Shutdown:
    """Router -> workers: leave the loop and exit cleanly."""


# ---- worker rank 0 -> router -------------------------------------------------------------------
@message
class StepDone:
    """Rank 0 finished `step`: tokens, logprobs and finish status of its requests are in shm. `finish` [B] uint8:
    each plan row's FinishReason after the step (NONE for a row that did not sample), the router's copy, since
    by the time it reads shm rank 0 may be writing the next step's. `done_at`: time.monotonic() as it was sent
    (CLOCK_MONOTONIC, one clock for every process of the machine), so the router times each step from when the
    worker could start it to when it ended, whether or not the next plan was already waiting. `num_accepted` [B]
    int32, only for a plan with spec_lens: each row published 1 + num_accepted tokens this step, the draft tokens
    rank 0 accepted and the model's token after them (a burst that eos, a stop id or the length ends is cut there,
    so fewer); every accepted draft token before the last published one has its KV row written."""
    step: int
    forward_s: float = 0.0
    finish: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    done_at: float = 0.0
    num_accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


# ---- worker rank 0 / router -> detokenizer ------------------------------------------------------
@message
class TokensReady:
    """New output tokens are published in these slots (rank 0, after each step)."""
    shm_indices: np.ndarray      # [B] int32
    req_ids: np.ndarray          # [B] int64


@message
class ReqReleased:
    """Router -> detokenizer: the router ended this request without a finish status in shm
    (abort); the detokenizer sends the final delta and drops its state."""
    shm_index: int
    req_id: int
    reason: FinishReason


# ---- detokenizer -> HTTP front -------------------------------------------------------------------
@message
class ReqDelta:
    """Text produced for one request since its previous delta."""
    shm_index: int
    req_id: int
    text: str
    token_ids: list[int]         # the tokens this delta covers (may be empty at finish)
    token_texts: list[str]       # per-token text pieces, for per-token streaming events
    logprobs: list[float]
    num_output: int              # output tokens so far
    finish: FinishReason = FinishReason.NONE
    cached_len: int = 0          # prompt tokens served from the prefix cache
    # per token of token_ids: its top_logprobs alternatives (token id, logprob), best first; empty
    # when the request asked for none
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Only on the first delta with tokens, and only for a request with prompt_logprobs: per prompt
    # token 1..prompt_len-1 its logprob, and its alternatives (token id, logprob), best first.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@message
class DeltaBatch:
    deltas: list[ReqDelta]


Message = AddReq | AbortReq | BatchPlan | Shutdown | StepDone | TokensReady | ReqReleased | DeltaBatch


def encode(msg: Message) -> bytes:
    return pickle.dumps(msg, protocol=5)


def decode(data: bytes) -> Message:
    return pickle.loads(data)
