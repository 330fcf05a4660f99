"""GrammarSet: rank 0's structured-output state (xgrammar): one matcher per constrained request,
advanced by every token it samples, and the batch's token bitmask applied to the logits at once.

The front checks grammar text (SamplingParams.validate) so a bad schema is a 400, not a worker error. The
tokenizer and compiler load on the first constrained request, so servers that never see one pay
nothing at start-up.

With `--reasoning_parser`, a request's grammar holds only what follows its reasoning, as the front's
parser splits it (lightserve/chat/reasoning_parsers.py): a `_Gate` per slot leaves the output free while
it is inside `<think>...</think>` and starts the matcher at the first token after the close tag.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve.chat.reasoning_parsers import REASONING_PARSERS
from lightserve.log import get_logger
from lightserve.sampling import GrammarKind

if TYPE_CHECKING:
    from lightserve.shm.req_pool import ReqPool

logger = get_logger(__name__)


class Phase(Enum):
    MAY_OPEN = "may_open"  # first token: the grammar's tokens or the first token of the open tag
    OPENING = "opening"    # the rest of a multi-token open tag is forced
    INSIDE = "inside"      # reasoning: no constraint until the close tag has been written
    ACTIVE = "active"      # the grammar holds every token


@dataclass
class _Gate:
    phase: Phase
    opened: int = 0                                  # OPENING: open-tag tokens written so far
    tail: list[int] = field(default_factory=list)    # INSIDE: the latest output tokens


class GrammarSet:
    TAIL = 16  # INSIDE: tokens decoded to find the close tag (it is 1-3 tokens in known tokenizers)

    def __init__(self, model_dir: str, vocab_size: int, reasoning_parser: str | None = None):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler = None
        self._tokenizer = None
        self.matchers: dict[int, object] = {}  # shm_index -> xgrammar.GrammarMatcher
        self.gates: dict[int, _Gate] = {}      # shm_index -> where its output is relative to the reasoning
        self._reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self._open_ids: list[int] = []         # the open tag's tokens, once the tokenizer is loaded

    def drop(self, slots: np.ndarray) -> None:
        """Forget the state of these slots (a new request took them, or theirs finished)."""
        for s in slots.tolist():
            self.matchers.pop(s, None)
            self.gates.pop(s, None)

    def mask(self, logits: torch.Tensor, slots: np.ndarray, rows: np.ndarray, kinds: np.ndarray,
             pool: ReqPool) -> None:
        """In place: tokens each constrained row's grammar forbids get -inf. logits [S, V];
        slots [S] shm_index; rows [G] the constrained rows of the batch; kinds [S] GrammarKind."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)       # [G, ceil(V / 32)] int32, all allowed
        for j, r in enumerate(rows.tolist()):  # NOTE: matchers are per request objects; the fill is C++
            slot = int(slots[r])
            gate = self._gate(slot, pool)
            if gate.phase is Phase.INSIDE:
                continue                                                        # row j stays all-allowed
            if gate.phase is Phase.OPENING:
                _only(bitmask, j, self._open_ids[gate.opened])
                continue
            self._matcher(slot, GrammarKind(int(kinds[r])), pool).fill_next_token_bitmask(bitmask, j)
            if gate.phase is Phase.MAY_OPEN:
                _allow(bitmask, j, self._open_ids[0])
        sub = logits[torch.from_numpy(rows).to(logits.device)]                 # [G, V]
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=self.vocab_size)
        logits[torch.from_numpy(rows).to(logits.device)] = sub

    def accept(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Advance each slot by its sampled token: its gate, then (once active) its matcher; a finished
        matcher is dropped."""
        for s, t in zip(slots.tolist(), ids.tolist()):
            gate = self.gates.get(s)
            if gate is not None and gate.phase is not Phase.ACTIVE and not self._advance_gate(gate, t):
                continue
            matcher = self.matchers.get(s)
            if matcher is None:
                continue
            if not matcher.accept_token(t):
                logger.error("slot %d: grammar rejected token %d (masked out); constraint dropped", s, t)
                self.matchers.pop(s)
            elif matcher.is_terminated():
                self.matchers.pop(s)

    def _advance_gate(self, gate: _Gate, token: int) -> bool:
        """Move `gate` past `token`; True when the token belongs to the grammar (the matcher takes it)."""
        if gate.phase is Phase.MAY_OPEN:
            if token != self._open_ids[0]:
                gate.phase = Phase.ACTIVE
                return True
            gate.phase, gate.opened = Phase.OPENING, 1
        elif gate.phase is Phase.OPENING:
            gate.opened += 1
        else:  # INSIDE
            gate.tail = (gate.tail + [token])[-self.TAIL:]
            text = self._tokenizer.decode(gate.tail, skip_special_tokens=False)
            if self._reasoning.CLOSE in text:
                gate.phase, gate.tail = Phase.ACTIVE, []
            return False
        if gate.phase is Phase.OPENING and gate.opened == len(self._open_ids):
            gate.phase = Phase.INSIDE
        return False

    def _gate(self, shm_index: int, pool: ReqPool) -> _Gate:
        """The slot's gate, made on its first constrained step: where its output starts, by the rule
        the front's reasoning parser applies to the prompt text."""
        gate = self.gates.get(shm_index)
        if gate is None:
            if self._reasoning is None:
                gate = _Gate(Phase.ACTIVE)
            else:
                self._get_compiler()  # loads the tokenizer
                n = int(pool.prompt_len[shm_index])
                tail = self._tokenizer.decode(pool.token_ids[shm_index, max(0, n - self.TAIL):n].tolist(),
                                              skip_special_tokens=False)
                inside = self._reasoning.always_starts_inside or tail.rstrip().endswith(self._reasoning.OPEN)
                gate = _Gate(Phase.INSIDE if inside else Phase.MAY_OPEN)
            self.gates[shm_index] = gate
        return gate

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

            from lightserve.hf_tokenizer import load_tokenizer

            tokenizer = self._tokenizer = load_tokenizer(self.model_dir)
            if self._reasoning is not None:
                self._open_ids = tokenizer.encode(self._reasoning.OPEN, add_special_tokens=False)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
            logger.info("grammar compiler ready")
        return self._compiler


def _only(bitmask: torch.Tensor, row: int, token: int) -> None:
    """bitmask [G, ceil(V / 32)] int32, bit t of a row = token t allowed: allow `token` alone in `row`."""
    bitmask[row] = 0
    _allow(bitmask, row, token)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    word, bit = divmod(token, 32)
    value = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # as a signed int32
