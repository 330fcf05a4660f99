"""The router tests' request pool: a real shared-memory segment, unlinked after each test."""
from __future__ import annotations

import os
import secrets

import pytest

from lightserve.shm.req_pool import ReqPool


@pytest.fixture
def pool():
    p = ReqPool.create(f"lightserve-{os.getpid()}-{secrets.token_hex(3)}-sched", num_slots=64, max_len=512)
    yield p
    p.close()
    p.segment.unlink()
