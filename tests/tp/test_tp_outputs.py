"""Real servers on CPU (gloo): greedy outputs with --tp N equal --tp 1, and a --tp the model's heads
cannot be split by is refused at start."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tp.conftest import TINY_NEW_TOKENS
from tests.tp.helpers import PROMPTS, SERVER_FLAGS, run_server

SMOLLM2_NEW_TOKENS = 16


@pytest.mark.timeout(1200)  # two SmolLM2 servers one after the other; 380 s on a loaded 2-core machine
def test_tp3_matches_tp1_on_smollm2(tmp_path):
    """SmolLM2-135M has 9 query heads and 3 KV heads: 3 ranks keep 3 query heads and 1 KV head each."""
    ref = run_server(tmp_path / "tp1.log", PROMPTS, SMOLLM2_NEW_TOKENS, "--tp", "1")
    got = run_server(tmp_path / "tp3.log", PROMPTS, SMOLLM2_NEW_TOKENS, "--tp", "3")
    assert got == ref
    assert sum(map(len, ref)) > 4 * len(PROMPTS)  # not a trivial comparison of end-of-text tokens


def test_tp2_matches_tp1_on_tiny_model(tiny_model_dir, tiny_tp2_outputs, tmp_path):
    ref = run_server(tmp_path / "tp1.log", PROMPTS, TINY_NEW_TOKENS, "--model_dir", str(tiny_model_dir))
    assert any(len(ids) > 1 for ids in ref)
    assert tiny_tp2_outputs == ref


def test_tp_that_does_not_divide_heads_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightserve.launch_server", *SERVER_FLAGS, "--tp", "2"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert "--tp 2 cannot split this model: 2 ranks do not divide the model's 9 attention heads" in proc.stderr, \
        proc.stderr[-2000:]
    assert "worker-tp" not in proc.stderr  # refused before any rank started


def test_tp2_over_an_int8_kv_cache_matches_tp1(tiny_model_dir, tmp_path):
    """Each rank quantizes and reads the rows of its own KV heads (a scale per token and head, so a head's rows do
    not depend on which rank holds it): --tp 2 with --kv_cache_dtype int8 gives --tp 1's tokens over the same cache."""
    flags = ("--model_dir", str(tiny_model_dir), "--kv_cache_dtype", "int8")
    ref = run_server(tmp_path / "tp1.log", PROMPTS, TINY_NEW_TOKENS, *flags)
    got = run_server(tmp_path / "tp2.log", PROMPTS, TINY_NEW_TOKENS, *flags, "--tp", "2")
    assert any(len(ids) > 1 for ids in ref)
    assert got == ref
