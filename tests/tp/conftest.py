"""Session fixtures of the TP tests: the tiny model folder and its single-node outputs, which both the
TP-2 test and the two-node test compare against."""
from __future__ import annotations

import pytest

from tests.tp.helpers import PROMPTS, make_tiny_llama, run_server

TINY_NEW_TOKENS = 24


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def tiny_tp2_outputs(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tiny-tp2") / "server.log"
    return run_server(log, PROMPTS, TINY_NEW_TOKENS, "--model_dir", str(tiny_model_dir), "--tp", "2")
