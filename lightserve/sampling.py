"""SamplingParams: one request's generation settings, shared by the HTTP API and the offline pipeline.

The numeric fields are copied into the request's shared-memory slot as one `PARAMS_DTYPE` record
(the worker reads a whole batch of them with one numpy gather); stop strings travel as UTF-8 JSON.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

MAX_STOP_TOKEN_IDS = 16   # stop_token_ids beyond this are refused at the edge
MAX_STOP_STR_BYTES = 1024  # UTF-8 JSON of the stop strings
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 64

PARAMS_DTYPE = np.dtype([
    ("max_new_tokens", np.int32),
    ("min_new_tokens", np.int32),
    ("temperature", np.float32),
    ("top_p", np.float32),
    ("top_k", np.int32),          # <= 0: off
    ("min_p", np.float32),
    ("repetition_penalty", np.float32),
    ("presence_penalty", np.float32),
    ("frequency_penalty", np.float32),
    ("seed", np.int64),
    ("ignore_eos", np.uint8),
    ("skip_special_tokens", np.uint8),
    ("top_logprobs", np.int32),   # alternatives to report per token
    ("disable_prompt_cache", np.uint8),
    ("num_stop_token_ids", np.int32),
    ("stop_token_ids", np.int32, (MAX_STOP_TOKEN_IDS,)),
])


class ParamError(ValueError):
    """A bad request parameter; `param` names the field, as the HTTP error body does."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class SamplingParams:
    """Generation settings of one request. temperature 0 means greedy (the default)."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    disable_prompt_cache: bool = False

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ParamError naming the first bad field; return self so calls chain."""
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ParamError(name, msg)

        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and value is not None:
                check(isinstance(value, int) and not isinstance(value, bool), f.name, "must be an integer")
            if f.type == "float":
                check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                      f.name, "must be a finite number")
            if f.type == "bool":
                check(isinstance(value, bool), f.name, "must be a boolean")
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "top_logprobs"):
            check(-2**31 < getattr(self, name) < 2**31, name, "is out of range")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be in [0, max_new_tokens]")
        check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1 or self.top_k == 0, "top_k", "must be -1 (off) or >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a list of non-empty strings")
        check(len(json.dumps(self.stop).encode()) <= MAX_STOP_STR_BYTES, "stop", "too long")
        check(isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
              "stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            check(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size),
                  "stop_token_ids", f"{t!r} is not a token id of this model")
        return self

    def to_record(self, record: np.ndarray) -> None:
        """Fill one PARAMS_DTYPE record (a 0-d view into shared memory)."""
        for name in PARAMS_DTYPE.names:
            if name in ("stop_token_ids", "num_stop_token_ids"):
                continue
            value = getattr(self, name)
            record[name] = -1 if value is None else value
        record["num_stop_token_ids"] = len(self.stop_token_ids)
        record["stop_token_ids"][: len(self.stop_token_ids)] = self.stop_token_ids

    def stop_bytes(self) -> bytes:
        return json.dumps(self.stop).encode() if self.stop else b""

    def as_dict(self) -> dict:
        return asdict(self)


def is_greedy(temperature: float, top_k: int) -> bool:
    return temperature <= 0.0 or top_k == 1
