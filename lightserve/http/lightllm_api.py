"""LightLLM-compatible generation routes: POST /generate and /generate_stream.

Body `{"inputs": str, "parameters": {...}}`; errors are `{"error": message, "param": field}`. The
stream sends one SSE event per output token, as LightLLM does.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any

from fastapi import Request
from starlette.responses import Response

from lightserve.engine.generation import EngineDead, RequestTimeout, ShuttingDown
from lightserve.http.front import (
    ApiError,
    ApiRouter,
    ErrorStyle,
    Front,
    best_of,
    check_n,
    dumps,
    encode_text,
    get_front,
    grammar_of,
    json_response,
    make_checked,
    parse_model,
    read_json,
    request_params,
    samples_of,
    stop_list,
    token_text,
)
from lightserve.http.metrics import ReqTimer
from lightserve.http.schema import SamplingFields, StrictModel
from lightserve.http.streams import (
    EventStream,
    Item,
    generate_one,
    run_all,
    start_stream,
    until_disconnect,
)
from lightserve.log import get_logger
from lightserve.messages import FinishReason, ReqDelta
from lightserve.sampling import SamplingParams

logger = get_logger(__name__)

router = ApiRouter(ErrorStyle.LIGHTLLM, generation=True)

# SamplingParams field -> request field, for error messages.
_NAMES = {f.name: f"parameters.{f.name}" for f in fields(SamplingParams)} | {"stop": "parameters.stop_sequences"}


class LightllmParams(SamplingFields):
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    do_sample: bool | None = None
    stop_sequences: Any = None  # str | list[str]; checked by stop_list
    add_special_tokens: bool | None = None
    return_details: bool | None = None
    best_of: int | None = None
    regular_constraint: str | None = None     # a regular expression


class GenerateRequest(StrictModel):
    inputs: str
    parameters: LightllmParams | None = None


@router.post("/generate")
async def generate(request: Request) -> Response:
    front = get_front(request)
    prompt_ids, params, details, n, num_samples = await _parse(request, front, stream=False)
    if num_samples == 1:
        outs = [await until_disconnect(request, generate_one(front, prompt_ids, params))]
    else:
        samples = samples_of(params, num_samples)
        outs = await until_disconnect(request, run_all(front, [prompt_ids] * num_samples, samples))
        outs = best_of(outs, n)
    g = outs[0]
    # n > 1 (LightLLM's diverse mode): one text per sample; the counts cover all of them.
    out: dict[str, Any] = {"generated_text": [o.text for o in outs],
                           "count_output_tokens": sum(o.num_output for o in outs),
                           "finish_reason": g.finish.api_name(), "prompt_tokens": g.prompt_len,
                           "prompt_cache_len": g.cached_len}
    if details:
        out["tokens"] = [{"id": i, "text": t, "logprob": lp}
                         for i, t, lp in zip(g.token_ids, g.token_texts, g.logprobs)]
        for token, alts in zip(out["tokens"], g.top_logprobs):
            token["top_logprobs"] = [{"id": i, "text": token_text(front, i), "logprob": lp} for i, lp in alts]
    return json_response(out)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    front = get_front(request)
    prompt_ids, params, _, _, num_samples = await _parse(request, front, stream=True)
    if num_samples > 1:
        raise ApiError(400, "n and best_of > 1 are not supported when streaming", "parameters.n")
    (timer,), items, (_, first) = await start_stream(request, front, [prompt_ids], [params])
    return EventStream(_events(front, first, items, len(prompt_ids), timer))


async def _parse(request: Request, front: Front, stream: bool) -> tuple[list[int], SamplingParams, bool, int, int]:
    """Prompt ids, params, return_details, n, and the number of samples to run (best_of >= n)."""
    req = parse_model(GenerateRequest, await read_json(request))
    p = req.parameters or LightllmParams()
    n = check_n(front, p.n, "parameters.n")
    num_samples = max(n, check_n(front, p.best_of, "parameters.best_of"))

    add_special = p.add_special_tokens if p.add_special_tokens is not None else True
    prompt_ids = await encode_text(front, req.inputs, "inputs", add_special)
    kind, grammar = grammar_of("parameters.guided_json", p.guided_json, p.regular_constraint, p.guided_grammar)
    # /generate shows logprobs with return_details and ranks best_of samples by them; /generate_stream always
    # shows them.
    params = request_params(p, front.sampling_defaults, stop=stop_list(p.stop_sequences, "parameters.stop_sequences"),
                            grammar_kind=kind, grammar=grammar,
                            report_logprobs=stream or bool(p.return_details) or num_samples > n)
    params = make_checked(front, prompt_ids, params, "inputs", _NAMES)
    if not p.do_sample:
        params.temperature = 0.0  # LightLLM: do_sample false (the default) is greedy; temperature still validated
    return prompt_ids, params, bool(p.return_details), n, num_samples


async def _events(front: Front, first: ReqDelta, items: AsyncIterator[Item], prompt_len: int,
                  timer: ReqTimer) -> AsyncIterator[bytes]:
    special = front.special_ids
    texts: list[str] = []
    delta: ReqDelta | None = first
    ended = False
    count = 0  # output tokens sent so far
    try:
        while delta is not None:
            texts.append(delta.text)
            num = len(delta.token_ids)
            done = delta.finish != FinishReason.NONE
            reason = delta.finish.api_name()
            if num:
                timer.on_tokens(num)
            count = delta.num_output - num
            events = []
            for j, (tid, text, logprob) in enumerate(zip(delta.token_ids, delta.token_texts, delta.logprobs)):
                last = done and j == num - 1
                count += 1
                token = {"id": tid, "text": text, "logprob": logprob, "special": tid in special,
                         "count_output_tokens": count, "prompt_tokens": prompt_len}
                events.append(_event(token, "".join(texts) if last else None, last, reason if last else None))
            if done:
                if num == 0:  # a finish without a token (abort, stop string): still one final event
                    events.append(_final_event(delta.num_output, prompt_len, "".join(texts), reason))
                ended = True
                timer.on_finish(reason)
            if events:
                yield b"".join(events)
            item = None if done else await anext(items, None)
            delta = None if item is None else item[1]
    except ShuttingDown:
        # The drain's grace period ended: the usual final event, with finish_reason "abort".
        ended = True
        timer.on_finish("abort")
        yield _final_event(count, prompt_len, "".join(texts), FinishReason.ABORT.api_name())
    except (RequestTimeout, EngineDead) as exc:
        ended = True
        timer.on_finish("error")
        yield b"data:" + dumps({"error": str(exc), "finished": True, "finish_reason": "abort"}) + b"\n\n"
    except Exception:
        logger.exception("stream failed")
        ended = True
        timer.on_finish("error")
        yield b"data:" + dumps({"error": "internal server error", "finished": True, "finish_reason": "abort"}) + b"\n\n"
    finally:
        if not ended:
            timer.on_finish("disconnect")
        await items.aclose()


def _final_event(num_output: int, prompt_len: int, generated_text: str, reason: str) -> bytes:
    """The last event of a stream whose finish came without a token (abort, stop string)."""
    token = {"id": None, "text": "", "logprob": None, "special": False, "count_output_tokens": num_output,
             "prompt_tokens": prompt_len}
    return _event(token, generated_text, True, reason)


def _event(token: dict, generated_text: str | None, finished: bool, reason: str | None) -> bytes:
    return b"data:" + dumps({"token": token, "generated_text": generated_text, "finished": finished,
                             "finish_reason": reason, "details": None}) + b"\n\n"
