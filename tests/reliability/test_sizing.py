"""Start-up sizing: the default longest request is capped below a long-context model's maximum (the per-slot
tables and the shm pool scale with it), and a pool larger than /dev/shm's free space is refused at start."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightserve.config import DEFAULT_MAX_REQ_TOTAL_LEN, Device, ServerConfig
from lightserve.engine.procs import StartError, check_shm_room
from lightserve.resolve_config import resolve_config
from lightserve.shm.req_pool import ReqPool
from tests.model.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama3", tmp_path_factory.mktemp("long"), max_position_embeddings=131072)


@pytest.fixture(scope="module")
def short_context_dir(tmp_path_factory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("short"), max_position_embeddings=2048)


@pytest.mark.parametrize("flag, expected", [(None, DEFAULT_MAX_REQ_TOTAL_LEN), (40000, 40000), (10**6, 131072)])
def test_long_context_model_gets_a_capped_default(long_context_dir, flag, expected):
    config = resolve_config(ServerConfig(model_dir=str(long_context_dir), device=Device.CPU, max_req_total_len=flag))
    assert config.max_req_total_len == expected


def test_short_context_model_keeps_its_own_maximum(short_context_dir):
    config = resolve_config(ServerConfig(model_dir=str(short_context_dir), device=Device.CPU))
    assert config.max_req_total_len == 2048


def test_default_pool_is_hundreds_of_mib_not_gigabytes():
    default = ReqPool.size_bytes(512, DEFAULT_MAX_REQ_TOTAL_LEN, 5)
    at_model_max = ReqPool.size_bytes(512, 131072, 5)
    assert default < 512 * 2**20 < 3 * 2**30 < at_model_max


def test_pool_larger_than_free_shm_is_refused(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    check_shm_room(free // 2, tmp_path)
    with pytest.raises(StartError, match="--max_req_total_len"):
        check_shm_room(free + 2**30, tmp_path)


@pytest.mark.parametrize("flags, expected", [
    ({}, (512, 512, 128)),
    (dict(batch_max_tokens=1024, prefill_join_tokens=1024), (1024, 1024, 1024)),
    (dict(chunked_prefill_size=64, prefill_join_tokens=32), (512, 64, 32)),
])
def test_cpu_step_budgets(short_context_dir, flags, expected):
    """On CPU a step holds at most 512 new tokens and takes in no further prompt past 128 of them."""
    config = resolve_config(ServerConfig(model_dir=str(short_context_dir), device=Device.CPU, **flags))
    assert (config.batch_max_tokens, config.chunked_prefill_size, config.prefill_join_tokens) == expected


def test_a_join_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="--prefill_join_tokens"):
        ServerConfig(prefill_join_tokens=0)
