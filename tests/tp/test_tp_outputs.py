"""Real servers on CPU (gloo): greedy outputs with --tp N equal --tp 1, and a --tp the model's heads
cannot be split by is refused at start."""
from __future__ import annotations

import subprocess
import sys

from tests.tp.conftest import TINY_NEW_TOKENS
from tests.tp.helpers import PROMPTS, SERVER_FLAGS, make_tiny_llama, run_server


def test_tp3_over_an_int8_kv_cache_matches_tp1(tmp_path):
    """6 query heads and 3 KV heads: 3 ranks keep 2 query heads and 1 KV head each (a split that is no power of
    two), and each rank quantizes and reads the int8 rows of its own KV head (a scale per token and head, so a
    head's rows do not depend on which rank holds it): --tp 3 gives --tp 1's tokens over the same cache."""
    model = make_tiny_llama(tmp_path / "model", hidden_size=96, intermediate_size=192, num_attention_heads=6,
                            num_key_value_heads=3)
    flags = ("--model_dir", str(model), "--kv_cache_dtype", "int8")
    ref = run_server(tmp_path / "tp1.log", PROMPTS, TINY_NEW_TOKENS, *flags)
    got = run_server(tmp_path / "tp3.log", PROMPTS, TINY_NEW_TOKENS, *flags, "--tp", "3")
    assert sum(map(len, ref)) > 4 * len(PROMPTS)  # not a trivial comparison of end-of-text tokens
    assert got == ref


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
