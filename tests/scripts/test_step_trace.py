"""scripts/step_trace.py reads back the router's per-step DEBUG lines (router/process.py step_line) as the server's
logging writes them, groups the steps and sums them; the server side is tests/e2e/test_router.py's chunked-prefill
test, whose server logs at DEBUG."""
import io
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightserve.log import configure_logging
from lightserve.messages import BatchPlan
from lightserve.router.process import step_line

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import step_trace  # noqa: E402  (scripts/ is not a package)


def _plan(step: int, prefix: list[int], extend: list[int], num_decode: int) -> BatchPlan:
    b, t = len(prefix), sum(extend)
    return BatchPlan(step=step, shm_indices=np.arange(b, dtype=np.int32), req_ids=np.arange(b, dtype=np.int64),
                     prefix_lens=np.array(prefix, np.int32), extend_lens=np.array(extend, np.int32),
                     sample=np.ones(b, bool), input_ids=np.zeros(t, np.int32), kv_locs=np.zeros(t, np.int32),
                     num_decode=num_decode)


@pytest.fixture
def router_log(monkeypatch):
    """Lines logged through the router process's logging setup at DEBUG; restores the root logger after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)  # where configure_logging's handler writes
    configure_logging("router", "debug")
    logger = logging.getLogger("lightserve.router.process")

    def log(plan: BatchPlan, forward_s: float, step_s: float) -> None:
        logger.debug("%s", step_line(plan, forward_s, step_s))

    yield log, lambda: out.getvalue().splitlines()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_lines_parse_back_and_sum(router_log):
    log, lines = router_log
    log(_plan(7, [10, 20, 30], [1, 1, 1], 3), 0.0251, 0.0262)             # three decoding, 63 KV tokens read
    log(_plan(8, [5, 7, 0, 100], [1, 1, 64, 40], 2), 0.4105, 0.4140)       # two decoding beside two prompt chunks
    log(_plan(9, [11], [1], 1), 0.0100, 0.0110)
    steps = step_trace.parse(lines())
    assert [(s.tokens, s.decode, s.kv, s.prefill, s.new, s.before) for s in steps] == [
        (3, 3, 63, 0, 0, 0), (106, 2, 14, 2, 104, 100), (1, 1, 12, 0, 0, 0)]
    assert [(s.forward_ms, s.step_ms) for s in steps] == [(25.1, 26.2), (410.5, 414.0), (10.0, 11.0)]
    table = step_trace.summarize(steps)
    assert list(table) == ["decode only, 1-1 requests", "decode only, 3-3 requests",
                           "with prompt chunks, 1-128 tokens", "all"]
    total = table["all"]
    assert total["steps"] == 3 and total["decode_tokens"] == 6 and total["prompt_tokens"] == 104
    assert total["seconds"] == pytest.approx((26.2 + 414.0 + 11.0) / 1e3)
    assert total["outside_forward_s"] == pytest.approx((1.1 + 3.5 + 1.0) / 1e3)
    assert table["with prompt chunks, 1-128 tokens"]["mean_kv_tokens"] == 14


def test_time_window_and_other_lines(router_log, tmp_path):
    log, lines = router_log
    log(_plan(1, [10], [1], 1), 0.01, 0.011)
    line = lines()[0]
    # The same step at three times, among lines that are not steps (the periodic INFO line names steps too).
    text = [f"10:00:00{line[8:]}", "10:00:01.000 INFO [router] lightserve.router.process: 2.0 steps/s, 64 tokens/step",
            f"10:00:05{line[8:]}", f"10:00:09{line[8:]}"]
    assert len(step_trace.parse(text)) == 3
    assert [s.time for s in step_trace.parse(text, start="10:00:01", end="10:00:05")] == ["10:00:05"]
    path = tmp_path / "server.log"
    path.write_text("\n".join(text) + "\n")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "step_trace.py"), str(path), "--start", "10:00:05"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("2 steps, 10:00:05 to 10:00:09")
    path.write_text(text[1] + "\n")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "step_trace.py"), str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "no step lines" in run.stderr
