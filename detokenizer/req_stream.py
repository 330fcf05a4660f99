"""ReqStream: one request's text state in the detokenizer (incremental decoder + stop strings).

Created by the detokenizer process when a req_id first appears in a pool slot; turns the tokens
published since the previous delta into the next ReqDelta. Knows nothing of sockets or shm.
"""
from __future__ import annotations

from collections.abc import Iterable

from lightserve.detokenizer.incremental import IncrementalDecoder, Tokenizer
from lightserve.detokenizer.stop_strings import StopChecker
from lightserve.messages import FinishReason, ReqDelta


class ReqStream:
    """Text deltas of one request.

    `token_texts` of a delta is aligned with its `token_ids` and joins to its `text`: each entry
    is the text that became safe to show when that token arrived ("" while a character is
    incomplete or a possible stop string is held back). The one exception is a final delta that
    covers no new token: the released held text is then in `text` only.
    """

    def __init__(self, shm_index: int, req_id: int, tokenizer: Tokenizer, context_ids: Iterable[int],
                 skip_special_tokens: bool, stop: list[str]):
        self.shm_index = shm_index
        self.req_id = req_id
        self.num_read = 0  # output tokens covered by deltas so far
        self._decoder = IncrementalDecoder(tokenizer, context_ids, skip_special_tokens)
        self._stop = StopChecker(stop)

    def advance(self, token_ids: list[int], logprobs: list[float], finish: FinishReason,
                cached_len: int = 0, top_logprobs: list[list[tuple[int, float]]] | None = None) -> ReqDelta:
        """The delta for tokens [num_read, num_read + len(token_ids)) of the output.

        `finish` is the pool's status (NONE while running). The delta's finish is STOP when a
        stop string matched; the tokens after the one that completed the match are dropped.
        A delta with finish != NONE is the stream's last.
        """
        texts: list[str] = []
        stopped = False
        for piece in self._decoder.push(token_ids):
            safe, stopped = self._stop.push(piece)
            texts.append(safe)
            if stopped:
                break
        n = len(texts)
        self.num_read += n
        tail = ""
        if stopped:
            finish = FinishReason.STOP
        elif finish != FinishReason.NONE:
            # Release what was held: an incomplete character (as U+FFFD, like decode would show
            # it) and a tail that could still have become a stop string.
            tail, stopped = self._stop.push(self._decoder.flush())
            if stopped:
                finish = FinishReason.STOP
            else:
                tail += self._stop.finish()
            if texts:
                texts[-1] += tail
                tail = ""
        return ReqDelta(
            shm_index=self.shm_index, req_id=self.req_id, text="".join(texts) + tail,
            token_ids=token_ids[:n], token_texts=texts, logprobs=logprobs[:n],
            num_output=self.num_read, finish=finish, cached_len=cached_len,
            top_logprobs=top_logprobs[:n] if top_logprobs else [])
