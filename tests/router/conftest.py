"""The router tests' request pool: a real shared-memory segment, unlinked after each test."""
from __future__ import annotations

import pytest


@pytest.fixture
def pool(make_pool):
    return make_pool(num_slots=64, max_len=512)
