"""The request schemas' shared bases: `StrictModel` (strict JSON types, unknown fields ignored) and
`SamplingFields`, the one definition of the sampling fields both generation APIs take.

Route modules subclass them for their request bodies; `front.parse_model` turns a validation error
into a 400 naming the field.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class StrictModel(BaseModel):
    """Request schemas: JSON types are checked strictly ("16" is not an int); unknown fields are ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


class SamplingFields(StrictModel):
    """The sampling fields the OpenAI and LightLLM request schemas share, each named as its
    SamplingParams field, so front.request_params copies every one a client sets. A new sampling
    parameter is one line here, its SamplingParams field and its use in the sampler. Every field is
    nullable: some clients send explicit nulls."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    disable_prompt_cache: bool | None = None
    skip_special_tokens: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict | None = None              # {"token id": bias in [-100, 100]}
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    n: int | None = None
    guided_json: Any = None                     # a JSON schema (object or string)
    guided_grammar: str | None = None           # an EBNF grammar

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict | None) -> dict[int, Any] | None:
        """JSON object keys are strings: "123" -> 123. The bias values are checked by SamplingParams."""
        if bias is None:
            return None
        out = {}
        for key, value in bias.items():
            try:
                out[int(key)] = value
            except (TypeError, ValueError):
                raise ValueError(f"keys must be token ids, got {key!r}") from None
        return out
