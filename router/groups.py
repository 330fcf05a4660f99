"""Groups: the n samples of one prompt (requests sharing `params.group_id`). The leader prefills the
prompt alone; once its prompt KV is in the radix cache the group is ready, and the siblings are
admitted and match it, computing one token each. Owned and called by the Scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass

from lightserve.router.req import Req


@dataclass
class Group:
    leader: Req
    members: int = 0
    ready: bool = False


class Groups:
    def __init__(self) -> None:
        self._by_id: dict[int, Group] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def join(self, req: Req) -> None:
        """A new request of group `req.group_id`; the first to arrive leads."""
        group = self._by_id.setdefault(req.group_id, Group(leader=req))
        group.members += 1

    def must_wait(self, req: Req) -> bool:
        """A sibling waits until its leader's prompt is cached (or the leader is gone)."""
        group = self._by_id.get(req.group_id) if req.group_id else None
        return group is not None and group.leader is not req and not group.ready

    def on_prompt_cached(self, req: Req) -> None:
        group = self._by_id.get(req.group_id) if req.group_id else None
        if group is not None and group.leader is req:
            group.ready = True

    def leave(self, req: Req) -> None:
        """`req` retired. A leader that leaves lets the siblings go ahead: its KV went to the cache
        (or it never ran)."""
        if not req.group_id:
            return
        group = self._by_id[req.group_id]
        group.members -= 1
        if group.leader is req:
            group.ready = True
        if group.members == 0:
            del self._by_id[req.group_id]
