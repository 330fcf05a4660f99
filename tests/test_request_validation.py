"""A request's validation has one home: SamplingParams.validate holds every rule of its parameters and
EngineClient.check_prompt (the HTTP front's and the pipeline's one call) adds the prompt's and the server's limits,
modifying nothing. Every SamplingParams and SamplingTensors field has its place in the slot's PARAMS_DTYPE record."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from lightserve.engine.client import EngineClient
from lightserve.model_infer.sampler import SamplingTensors
from lightserve.sampling import MAX_TOP_LOGPROBS, PARAMS_DTYPE, ParamError, SamplingParams

VOCAB = 1000
CONTEXT = 64
# SamplingParams fields the record does not hold, and the request slot's fields that carry them instead.
CARRIED_ELSEWHERE = {"stop": ("stop_json", "stop_len"), "grammar": ("grammar", "grammar_len"),
                     "logit_bias": ("params.logit_bias_ids", "params.logit_bias_values", "params.num_logit_bias")}


def _engine(max_top_logprobs: int = 5) -> SimpleNamespace:
    """What EngineClient.check_prompt reads of its client."""
    return SimpleNamespace(max_req_total_len=CONTEXT, vocab_size=VOCAB,
                           pool=SimpleNamespace(max_top_logprobs=max_top_logprobs))


def check_prompt(prompt_ids: list[int], params: SamplingParams, max_top_logprobs: int = 5) -> SamplingParams:
    return EngineClient.check_prompt(_engine(max_top_logprobs), prompt_ids, params)


def _param_of_error(params: SamplingParams, **limits) -> str | None:
    try:
        params.validate(VOCAB, **limits)
    except ParamError as exc:
        return exc.param
    return None


def test_every_sampling_field_has_its_place_in_the_record(make_pool):
    slot_fields = {name for name in vars(make_pool(num_slots=1, max_len=8)) if not name.startswith("_")}
    for f in dataclasses.fields(SamplingParams):
        if f.name in CARRIED_ELSEWHERE:
            for home in CARRIED_ELSEWHERE[f.name]:
                assert home.removeprefix("params.") in (PARAMS_DTYPE.names if "." in home else slot_fields), home
        else:
            assert f.name in PARAMS_DTYPE.names, f"SamplingParams.{f.name} is not in PARAMS_DTYPE"
    for f in dataclasses.fields(SamplingTensors):
        assert f.name == "step" or f.name in PARAMS_DTYPE.names, f"SamplingTensors.{f.name} is not in PARAMS_DTYPE"


def test_every_field_round_trips_through_the_record():
    """to_record fills every PARAMS_DTYPE field from its SamplingParams field (the lists and their counts too)."""
    params = SamplingParams(max_new_tokens=9, min_new_tokens=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1,
                            repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=-0.5, seed=11,
                            ignore_eos=True, skip_special_tokens=False, top_logprobs=3, report_logprobs=False,
                            prompt_logprobs=2, disable_prompt_cache=True, stop_token_ids=[5, 6],
                            logit_bias={4: 1.5}, allowed_token_ids=[1, 2, 3], grammar_kind=1, group_id=13)
    record = np.zeros((), PARAMS_DTYPE)
    params.validate(VOCAB).to_record(record)
    scalars = {name for name in PARAMS_DTYPE.names if PARAMS_DTYPE[name].shape == () and not name.startswith("num_")}
    assert {name: record[name].item() for name in scalars} == pytest.approx(
        {name: float(getattr(params, name)) for name in scalars})
    assert record["stop_token_ids"][:record["num_stop_token_ids"]].tolist() == [5, 6]
    assert record["allowed_token_ids"][:record["num_allowed_token_ids"]].tolist() == [1, 2, 3]
    assert (record["num_logit_bias"], record["logit_bias_ids"][0], record["logit_bias_values"][0]) == (1, 4, 1.5)


INT_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.type in ("int", "int | None")]


@pytest.mark.parametrize("name", INT_FIELDS)
def test_an_integer_field_must_fit_its_record_type(name):
    """One bound per integer field, its PARAMS_DTYPE type's: one past it is out of range, the bound itself is not
    (another rule may still refuse it)."""
    bounds = np.iinfo(PARAMS_DTYPE[name])
    for outside in (bounds.min - 1, bounds.max + 1):
        with pytest.raises(ParamError, match="is out of range") as exc:
            SamplingParams(**{name: outside}).validate(VOCAB)
        assert exc.value.param == name
    for edge in (bounds.min, bounds.max):
        try:
            SamplingParams(**{name: edge}).validate(VOCAB)
        except ParamError as exc:  # the field's own rule may refuse it, never the bound
            assert exc.param == name and exc.message != "is out of range", (name, edge, exc)


def test_top_logprobs_are_bounded_by_the_server_once():
    """Without a server the slot's largest K (MAX_TOP_LOGPROBS); with one, its --max_top_logprobs, for the output's
    alternatives and the prompt's alike."""
    assert _param_of_error(SamplingParams(top_logprobs=MAX_TOP_LOGPROBS)) is None
    assert _param_of_error(SamplingParams(top_logprobs=MAX_TOP_LOGPROBS + 1)) == "top_logprobs"
    for name in ("top_logprobs", "prompt_logprobs"):
        assert check_prompt([1, 2], SamplingParams(**{name: 2}), max_top_logprobs=2) is not None
        with pytest.raises(ParamError, match=r"must be in \[0, 2\] \(--max_top_logprobs\)") as exc:
            check_prompt([1, 2], SamplingParams(**{name: 3}), max_top_logprobs=2)
        assert exc.value.param == name


def test_check_prompt_modifies_nothing():
    """A request whose max_new_tokens exceeds the room after its prompt runs a capped copy; the caller's params (one
    object for several prompts of a completions request, or a pipeline's reused config) keep their values."""
    params = SamplingParams(max_new_tokens=50, min_new_tokens=40)
    long_prompt = check_prompt(list(range(30)), params)
    assert (long_prompt.max_new_tokens, long_prompt.min_new_tokens) == (CONTEXT - 30, CONTEXT - 30)
    assert (params.max_new_tokens, params.min_new_tokens) == (50, 40)
    assert check_prompt([1, 2], params) is params  # nothing to cap: no copy


def test_a_written_request_fits_the_pool(make_pool):
    """The pool takes only what check_prompt passed: rank 0 and the readers use top_logprobs as they are."""
    pool = make_pool(num_slots=1, max_len=8, max_top_logprobs=2)
    pool.write_request(0, [1, 2], SamplingParams(top_logprobs=2, prompt_logprobs=2), seed=0)
    with pytest.raises(AssertionError):
        pool.write_request(0, [1, 2], SamplingParams(top_logprobs=3), seed=0)
