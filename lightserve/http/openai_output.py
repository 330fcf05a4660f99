"""The pieces of OpenAI's response bodies that need more than a field: logprobs in the completions
and chat shapes, the echoed prompt, vLLM's prompt_logprobs, usage, and a completion's choices (whole and
as stream chunks). Called by openai_api.py and openai_stream.py.
"""
from __future__ import annotations

from collections.abc import Callable

from lightserve.engine.generation import Generation
from lightserve.http.front import Front, token_text
from lightserve.messages import ReqDelta


def token_name(front: Front, token_id: int, as_ids: bool) -> str:
    """How a logprobs entry names a token: its text, or vLLM's `token_id:N` (return_tokens_as_token_ids, for
    clients that need the exact ids: evaluation, RL)."""
    return f"token_id:{token_id}" if as_ids else token_text(front, token_id)


def token_names(ids: list[int], texts: list[str], as_ids: bool) -> list[str]:
    """The names of a run of sampled tokens (their detokenized texts as they are, or `token_id:N`)."""
    return [f"token_id:{i}" for i in ids] if as_ids else texts


def completion_logprobs(front: Front, texts: list[str], logprobs: list[float],
                         top: list[list[tuple[int, float]]], offset: int, as_ids: bool = False) -> tuple[dict, int]:
    """`texts`: the tokens' names (token_names); `as_ids` names the alternatives by id too."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top_dicts = [{token_name(front, i, as_ids): lp for i, lp in alts} for alts in top] if top else None
    return {"tokens": texts, "token_logprobs": logprobs, "text_offset": offsets, "top_logprobs": top_dicts}, offset


def with_echo(front: Front, prompt_ids: list[int], prompt_lps: list[float] | None,
               prompt_top: list[list[tuple[int, float]]] | None, text: str, logprobs: dict | None,
               want_logprobs: bool, as_ids: bool = False) -> tuple[str, dict | None, int]:
    """The prompt prepended to a choice's text and, with logprobs, to its token lists (the first
    prompt token has no logprob: None, as OpenAI gives it). Returns (text, logprobs, next offset)."""
    prompt_text = front.tokenizer.decode(prompt_ids)
    if not want_logprobs:
        return prompt_text + text, logprobs, 0
    texts = [token_name(front, t, as_ids) for t in prompt_ids]
    lps: list[float | None] = [None] + (prompt_lps if prompt_lps is not None else [None] * (len(prompt_ids) - 1))
    tops = [None] + [{token_name(front, t, as_ids): lp for t, lp in alts}
                     for alts in (prompt_top or [[]] * (len(lps) - 1))]
    head, offset = completion_logprobs(front, texts, lps, [], 0)
    head["top_logprobs"] = tops
    tail = logprobs or {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": None}
    merged = {"tokens": head["tokens"] + tail["tokens"],
              "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
              "text_offset": head["text_offset"] + [o + offset for o in tail["text_offset"]],
              "top_logprobs": tops + (tail["top_logprobs"] or [{} for _ in tail["tokens"]])}
    return prompt_text + text, merged, offset + sum(len(t) for t in tail["tokens"])


def vllm_prompt_logprobs(front: Front, prompt_ids: list[int], prompt_lps: list[float] | None,
                          prompt_top: list[list[tuple[int, float]]] | None) -> list[dict | None] | None:
    """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank?, decoded_token}}
    holding the prompt token itself and its alternatives (rank given for the alternatives)."""
    if prompt_lps is None:
        return None
    out: list[dict | None] = [None]
    for tok, lp, alts in zip(prompt_ids[1:], prompt_lps, prompt_top or [[]] * len(prompt_lps)):
        entry = {str(t): {"logprob": a, "rank": r, "decoded_token": token_text(front, t)}
                 for r, (t, a) in enumerate(alts, start=1)}
        entry.setdefault(str(tok), {"logprob": lp, "decoded_token": token_text(front, tok)})
        out.append(entry)
    return out


def chat_logprobs(front: Front, texts: list[str], logprobs: list[float], top: list[list[tuple[int, float]]],
                  as_ids: bool = False) -> dict:
    """`texts`: the tokens' names (token_names); `as_ids` names the alternatives by id too."""
    def alt(i: int, lp: float) -> dict:
        text = token_name(front, i, as_ids)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                "top_logprobs": [alt(i, a) for i, a in top[j]] if j < len(top) else []}
               for j, (t, lp) in enumerate(zip(texts, logprobs))]
    return {"content": content, "refusal": None}


def usage(outs: list[Generation]) -> dict:
    return usage_dict(sum(g.prompt_len for g in outs), sum(g.num_output for g in outs),
                       sum(g.cached_len for g in outs))


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_chunks(front: Front, prompts: list[list[int]], echo: bool, logprobs_k: int | None,
                      prompt_logprobs_k: int | None, as_ids: bool = False) -> Callable[[int, ReqDelta], dict | None]:
    """A completion stream's chunk of choice i for each delta (None: nothing to send); the first one echoes
    the prompt. `logprobs_k`, `prompt_logprobs_k`, `as_ids`: the request's `logprobs`, `prompt_logprobs`,
    `return_tokens_as_token_ids`."""
    want_logprobs = logprobs_k is not None
    offsets = [0] * len(prompts)
    echoed = [not echo] * len(prompts)

    def chunk(i: int, delta: ReqDelta) -> dict | None:
        text, logprobs = delta.text, None
        if want_logprobs:
            logprobs, offsets[i] = completion_logprobs(front, token_names(delta.token_ids, delta.token_texts, as_ids),
                                                        delta.logprobs, delta.top_logprobs, offsets[i], as_ids)
        if not echoed[i]:
            echoed[i] = True
            text, logprobs, offsets[i] = with_echo(front, prompts[i], delta.prompt_logprobs,
                                                    delta.prompt_top_logprobs, text, logprobs, want_logprobs, as_ids)
        if not text and not delta.finish and not (want_logprobs and delta.token_ids):
            return None
        body = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": delta.finish.api_name()}
        if delta.prompt_logprobs is not None and prompt_logprobs_k is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(front, prompts[i], delta.prompt_logprobs,
                                                            delta.prompt_top_logprobs)
        return body

    return chunk


def completion_choice(front: Front, i: int, prompt_ids: list[int], g: Generation, echo: bool, logprobs_k: int | None,
                      prompt_logprobs_k: int | None, as_ids: bool = False) -> dict:
    """Choice i of a completion response, as completion_chunks' arguments say."""
    want_logprobs = logprobs_k is not None
    text = g.text
    logprobs = completion_logprobs(front, token_names(g.token_ids, g.token_texts, as_ids), g.logprobs,
                                   g.top_logprobs, 0, as_ids)[0] if want_logprobs else None
    if echo:
        text, logprobs, _ = with_echo(front, prompt_ids, g.prompt_logprobs, g.prompt_top_logprobs, text, logprobs,
                                       want_logprobs, as_ids)
    choice = {"index": i, "text": text, "finish_reason": g.finish.api_name(), "logprobs": logprobs}
    if prompt_logprobs_k is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(front, prompt_ids, g.prompt_logprobs, g.prompt_top_logprobs)
    return choice
