"""StopChecker: cuts one request's streamed text at the first stop string (OpenAI `stop`).

Owned by the detokenizer's ReqStream. The stop string itself is not part of the output (as in
OpenAI and vLLM), and text that a later piece could turn into a stop string is held back, so a
streaming client never sees text that the final answer does not contain.
"""
from __future__ import annotations


class StopChecker:
    """Fed the text pieces in order; returns the part of the text that is safe to show now.

    Invariant: the held text is the longest tail of everything seen that is a proper prefix of
    some stop string. Any future match must start inside it (or in text not seen yet), so each
    push searches only held + piece: O(max stop length + piece), never the whole output.
    """

    def __init__(self, stop: list[str]):
        assert all(stop), "stop strings must be non-empty (validated at the HTTP edge)"
        self._stop = list(dict.fromkeys(stop))
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit now, stopped). After a stop, every push returns ("", True)."""
        if self.stopped:
            return "", True
        if not self._stop:
            return piece, False
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            return text[:cut], True
        keep = _stop_prefix_len(text, self._stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def finish(self) -> str:
        """At the end of the request (no stop string matched): release the held text."""
        held, self._held = self._held, ""
        return held


def _stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        # Only a tail shorter than s can be a proper prefix of it; the earliest start that
        # matches is the longest such tail for this s.
        start = max(len(text) - len(s) + 1, 0)
        i = text.find(s[0], start)
        while i != -1:
            if s.startswith(text[i:]):
                best = max(best, len(text) - i)
                break
            i = text.find(s[0], i + 1)
    return best
