"""GrammarSet: rank 0's structured-output state (xgrammar): one matcher per constrained request,
advanced by every token it samples, and the batch's token bitmask applied to the logits at once.

The front checks grammar text (SamplingParams.validate) so a bad schema is a 400, not a worker error. The
tokenizer and compiler load on the first constrained request, so servers that never see one pay
nothing at start-up.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.log import get_logger
from lightserve.sampling import GrammarKind

if TYPE_CHECKING:
    from lightserve.shm.req_pool import ReqPool

logger = get_logger(__name__)


class GrammarSet:
    def __init__(self, model_dir: str, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler = None
        self.matchers: dict[int, object] = {}  # shm_index -> xgrammar.GrammarMatcher

    def drop(self, slots: np.ndarray) -> None:
        """Forget the matchers of these slots (a new request took them, or theirs finished)."""
        for s in slots.tolist():
            self.matchers.pop(s, None)

    def mask(self, logits: torch.Tensor, slots: np.ndarray, rows: np.ndarray, kinds: np.ndarray,
             pool: ReqPool) -> None:
        """In place: tokens each constrained row's grammar forbids get -inf. logits [S, V];
        slots [S] shm_index; rows [G] the constrained rows of the batch; kinds [S] GrammarKind."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)       # [G, ceil(V / 32)] int32
        for j, r in enumerate(rows.tolist()):  # NOTE: matchers are per request objects; the fill is C++
            matcher = self._matcher(int(slots[r]), GrammarKind(int(kinds[r])), pool)
            matcher.fill_next_token_bitmask(bitmask, j)
        sub = logits[torch.from_numpy(rows).to(logits.device)]                 # [G, V]
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=self.vocab_size)
        logits[torch.from_numpy(rows).to(logits.device)] = sub

    def accept(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Advance each slot's matcher by its sampled token; finished matchers are dropped."""
        for s, t in zip(slots.tolist(), ids.tolist()):
            matcher = self.matchers.get(s)
            if matcher is None:
                continue
            if not matcher.accept_token(t):
                logger.error("slot %d: grammar rejected token %d (masked out); constraint dropped", s, t)
                self.matchers.pop(s)
            elif matcher.is_terminated():
                self.matchers.pop(s)

    def _matcher(self, shm_index: int, kind: GrammarKind, pool: ReqPool):
        matcher = self.matchers.get(shm_index)
        if matcher is None:
            import xgrammar as xgr

            compiled = self._compile(kind, pool.grammar_text(shm_index))
            matcher = self.matchers[shm_index] = xgr.GrammarMatcher(compiled)
        return matcher

    def _compile(self, kind: GrammarKind, text: str):
        # GrammarCompiler caches compiled grammars by their text, so repeated schemas compile once.
        compiler = self._get_compiler()
        match kind:
            case GrammarKind.JSON_OBJECT:
                return compiler.compile_builtin_json_grammar()
            case GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(text, any_whitespace=False)
            case GrammarKind.REGEX:
                return compiler.compile_regex(text)
            case GrammarKind.EBNF:
                return compiler.compile_grammar(text)
        raise AssertionError(kind)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
            logger.info("grammar compiler ready")
        return self._compiler
