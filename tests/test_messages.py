"""lightserve/messages.py: every message survives the wire format with each field intact, and pickles as its
constructor call rather than through dataclasses' per-object state functions."""
import dataclasses
import pickletools

import numpy as np
import pytest

from lightserve.messages import (
    AbortReq,
    AddReq,
    BatchPlan,
    DeltaBatch,
    FinishReason,
    ReqDelta,
    ReqReleased,
    Shutdown,
    StepDone,
    TokensReady,
    decode,
    encode,
)

DELTA = ReqDelta(3, 17, " word", [123], [" word"], [-0.5], 10, FinishReason.LENGTH, 4,
                 [[(123, -0.5), (7, -1.25)]], [0.0, -2.5], [[(9, -2.5)]])
PLAN = BatchPlan(5, np.array([0, 2], np.int32), np.array([10, 11], np.int64), np.array([4, 0], np.int32),
                 np.array([1, 3], np.int32), np.array([True, False]), np.arange(4, dtype=np.int32),
                 np.arange(10, 14, dtype=np.int32), 1, fill_rows=np.array([2], np.int32),
                 fill_pos=np.array([0], np.int32), fill_locs=np.array([9], np.int32),
                 prompt_logit_idx=np.array([2], np.int32))
MESSAGES = [AddReq(1, 2), AbortReq(1, 2, FinishReason.STOP), PLAN, Shutdown(), StepDone(7, 0.25),
            TokensReady(np.array([0, 2], np.int32), np.array([10, 11], np.int64)),
            ReqReleased(4, 9, FinishReason.ABORT), DeltaBatch([DELTA, dataclasses.replace(DELTA, shm_index=4)])]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_round_trips_with_every_field(msg):
    back = decode(encode(msg))
    assert _same(msg, back), (msg, back)
    for f in dataclasses.fields(back)[:1]:  # still frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(back, f.name, None)


def test_messages_pickle_as_constructor_calls():
    """No object goes through dataclasses' __setstate__ (which walks fields() per object): the pickle builds each
    with its class and a tuple of values (REDUCE), never BUILD."""
    ops = {op.name for op, _, _ in pickletools.genops(encode(MESSAGES[-1]))}
    assert "REDUCE" in ops and "BUILD" not in ops, ops
    assert b"_dataclass_setstate" not in encode(MESSAGES[-1])
