"""Admission: may a waiting request start now, given free KV and what the running batch will need?

Optimistic (default, like vLLM and SGLang): a running request is expected to generate only a
`new_token_ratio` share of its remaining max_new_tokens, so the server runs near full KV use. The
ratio decays while steps go by without trouble and jumps back up when the router has to pause, so
a wrong estimate corrects itself. Conservative: the ratio is pinned at 1.0, every request's full
max_new_tokens is reserved, and the router never needs to pause.
"""
from __future__ import annotations

import math
from typing import Iterable

from lightserve.config import AdmissionPolicy
from lightserve.router.req import Req

INIT_RATIO = 0.7
MIN_RATIO = 0.15
DECAY_STEPS = 600      # steps for the ratio to fall from INIT_RATIO to MIN_RATIO
PAUSE_BUMP = 0.25      # added to the ratio each time requests had to be paused


class Admission:
    def __init__(self, policy: AdmissionPolicy):
        self.policy = policy
        self.ratio = 1.0 if policy is AdmissionPolicy.CONSERVATIVE else INIT_RATIO

    def future_need(self, req: Req) -> int:
        """KV rows `req` is expected to still need for the tokens it will generate."""
        return math.ceil(self.ratio * req.remaining_new_tokens)

    def running_need(self, running: Iterable[Req]) -> int:
        return sum(self.future_need(r) for r in running)

    def can_admit(self, req: Req, prompt_need: int, available: int, reserved: int) -> bool:
        """`prompt_need`: rows the request takes now (its uncached tokens); `available`: free rows
        plus rows the prefix cache could evict; `reserved`: running_need of the running batch."""
        return prompt_need + self.future_need(req) + reserved <= available

    def on_step(self) -> None:
        if self.policy is AdmissionPolicy.OPTIMISTIC:
            self.ratio = max(MIN_RATIO, self.ratio - (INIT_RATIO - MIN_RATIO) / DECAY_STEPS)

    def on_pause(self) -> None:
        if self.policy is AdmissionPolicy.OPTIMISTIC:
            self.ratio = min(1.0, self.ratio + PAUSE_BUMP)
