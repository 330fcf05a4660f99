"""SamplingParams: one request's generation settings, shared by the HTTP API and the offline pipeline.

The numeric fields are copied into the request's shared-memory slot as one `PARAMS_DTYPE` record
(the worker reads a whole batch of them with one numpy gather); stop strings travel as UTF-8 JSON.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from enum import IntEnum

import numpy as np

MAX_STOP_TOKEN_IDS = 16   # stop_token_ids beyond this are refused at the edge
MAX_STOP_STR_BYTES = 1024  # UTF-8 JSON of the stop strings
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 64        # logit_bias entries per request
MAX_ALLOWED_TOKEN_IDS = 64  # allowed_token_ids per request
MAX_GRAMMAR_BYTES = 16384   # UTF-8 of a JSON schema / regex / EBNF grammar


class GrammarKind(IntEnum):
    """What the request's grammar text is (params.grammar_kind); the worker compiles it with xgrammar."""
    NONE = 0
    JSON_OBJECT = 1   # any JSON object; no text
    JSON_SCHEMA = 2
    REGEX = 3
    EBNF = 4

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
    ("report_logprobs", np.uint8),  # 0: no output token's logprob is shown (the worker may approximate or zero them)
    ("disable_prompt_cache", np.uint8),
    ("prompt_logprobs", np.int32),  # -1: none; k >= 0: each prompt token's logprob and k alternatives
    ("num_stop_token_ids", np.int32),
    ("stop_token_ids", np.int32, (MAX_STOP_TOKEN_IDS,)),
    ("num_logit_bias", np.int32),
    ("logit_bias_ids", np.int32, (MAX_LOGIT_BIAS,)),
    ("logit_bias_values", np.float32, (MAX_LOGIT_BIAS,)),
    ("num_allowed_token_ids", np.int32),  # 0: every token allowed
    ("allowed_token_ids", np.int32, (MAX_ALLOWED_TOKEN_IDS,)),
    ("grammar_kind", np.uint8),   # GrammarKind; the text is the slot's `grammar` field
    ("group_id", np.int64),       # != 0: one of the n samples of one prompt (prefilled once, router)
    ("lora_id", np.int32),        # != 0: the LoRA adapter the request runs under (router: its slot and cache keys)
])
_LIST_FIELDS = ("stop_token_ids", "logit_bias", "allowed_token_ids")  # filled by to_record's own code


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
    # Whether the chosen tokens' logprobs are shown or used (returned, or ranking best_of samples). An API that
    # shows none sets False: a float32 model's greedy steps may then pick the token from logits exact only near
    # their maximum (kernels/argmax_head.py), whose logprob is approximate.
    report_logprobs: bool = True
    # None: no prompt logprobs. k: the logprob of every prompt token after the first, with its k
    # best alternatives (OpenAI echo + logprobs, vLLM prompt_logprobs). Such a request never reads
    # its prompt from the prefix cache: the cache holds KV, not the logits the logprobs come from.
    prompt_logprobs: int | None = None
    disable_prompt_cache: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] = field(default_factory=list)   # empty: all tokens
    grammar_kind: int = GrammarKind.NONE
    grammar: str = ""
    group_id: int = 0  # set by the front for the n samples of one prompt; not a client field
    lora_id: int = 0  # set by the front from the adapter the request's `model` names (0: the base); not a client field

    def validate(self, vocab_size: int | None = None, max_top_logprobs: int = MAX_TOP_LOGPROBS) -> SamplingParams:
        """Raise ParamError naming the first bad field; return self so calls chain. Every rule of a request's
        parameters is here (EngineClient.check_prompt adds the prompt's and passes the server's limits: the vocabulary
        and --max_top_logprobs, the alternatives a request slot holds)."""
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ParamError(name, msg)

        assert 0 <= max_top_logprobs <= MAX_TOP_LOGPROBS, max_top_logprobs
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and value is not None:
                check(isinstance(value, int) and not isinstance(value, bool), f.name, "must be an integer")
                # Every integer field is a PARAMS_DTYPE field: the value must fit its type there.
                bounds = np.iinfo(PARAMS_DTYPE[f.name])
                check(bounds.min <= value <= bounds.max, f.name, "is out of range")
            if f.type == "float":
                check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                      f.name, "must be a finite number")
            if f.type == "bool":
                check(isinstance(value, bool), f.name, "must be a boolean")
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
        top = f"must be in [0, {max_top_logprobs}]"
        if max_top_logprobs < MAX_TOP_LOGPROBS:  # the server's own limit, below what a request slot could hold
            top += " (--max_top_logprobs)"
        check(0 <= self.top_logprobs <= max_top_logprobs, "top_logprobs", top)
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= max_top_logprobs, "prompt_logprobs", top)
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be a list of non-empty strings")
        check(len(json.dumps(self.stop).encode()) <= MAX_STOP_STR_BYTES, "stop", "too long")
        check(isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
              "stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            check(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size),
                  "stop_token_ids", f"{t!r} is not a token id of this model")
        check(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
              f"must map at most {MAX_LOGIT_BIAS} token ids to numbers")
        for t, v in self.logit_bias.items():
            check(_is_token_id(t, vocab_size), "logit_bias", f"{t!r} is not a token id of this model")
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and -100.0 <= v <= 100.0, "logit_bias",
                  f"the bias of token {t} must be a number in [-100, 100]")
        check(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
              "allowed_token_ids", f"must be a list of at most {MAX_ALLOWED_TOKEN_IDS} ids")
        for t in self.allowed_token_ids:
            check(_is_token_id(t, vocab_size), "allowed_token_ids", f"{t!r} is not a token id of this model")
        check(self.grammar_kind in GrammarKind.__members__.values(), "grammar_kind", "unknown grammar kind")
        check(isinstance(self.grammar, str) and len(self.grammar.encode()) <= MAX_GRAMMAR_BYTES, "grammar",
              f"must be at most {MAX_GRAMMAR_BYTES} bytes")
        if self.grammar_kind != GrammarKind.NONE:
            try:
                check_grammar(GrammarKind(self.grammar_kind), self.grammar)
            except ValueError as exc:
                raise ParamError("grammar", f"invalid {GrammarKind(self.grammar_kind).name.lower()}: {exc}") from None
        return self

    def to_record(self, record: np.ndarray) -> None:
        """Fill one PARAMS_DTYPE record (a 0-d view into shared memory)."""
        for name in PARAMS_DTYPE.names:
            if name.startswith("num_") or any(name.startswith(f) for f in _LIST_FIELDS):
                continue
            value = getattr(self, name)
            record[name] = -1 if value is None else value
        record["num_stop_token_ids"] = len(self.stop_token_ids)
        record["stop_token_ids"][: len(self.stop_token_ids)] = self.stop_token_ids
        record["num_logit_bias"] = len(self.logit_bias)
        record["logit_bias_ids"][: len(self.logit_bias)] = list(self.logit_bias.keys())
        record["logit_bias_values"][: len(self.logit_bias)] = list(self.logit_bias.values())
        record["num_allowed_token_ids"] = len(self.allowed_token_ids)
        record["allowed_token_ids"][: len(self.allowed_token_ids)] = self.allowed_token_ids

    def stop_bytes(self) -> bytes:
        return json.dumps(self.stop).encode() if self.stop else b""


def check_grammar(kind: GrammarKind, text: str) -> None:
    """Parse a grammar without a tokenizer (the worker compiles it); ValueError with xgrammar's message."""
    import xgrammar as xgr  # imported only by requests that use a grammar

    try:
        match kind:
            case GrammarKind.JSON_SCHEMA:
                json.loads(text)
                xgr.Grammar.from_json_schema(text, any_whitespace=False)
            case GrammarKind.REGEX:
                xgr.Grammar.from_regex(text)
            case GrammarKind.EBNF:
                xgr.Grammar.from_ebnf(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises assorted RuntimeError/ValueError types
        lines = str(exc).strip().splitlines()
        # xgrammar prefixes "[hh:mm:ss] /path/file.cc:line: "; the client needs only the message.
        message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(exc).__name__
        raise ValueError(message) from None


# generation_config.json keys applied as request defaults (as vLLM applies them), all SamplingParams fields.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(folder: str) -> dict[str, float | int]:
    """The sampling defaults a model folder's generation_config.json sets (empty without one).
    HF's `do_sample: false` means greedy, whatever temperature the file also names."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    out = {k: config[k] for k in GENERATION_CONFIG_KEYS
           if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
    if config.get("do_sample") is False and out:
        out["temperature"] = 0.0
    return out


def _is_token_id(t: object, vocab_size: int | None) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (vocab_size is None or t < vocab_size)
