"""scripts/gpu_check.sh's dry run: every stage on CPU with small shapes (checkpoints built by transformers, the
model runner and a real server against transformers, the timing stage), so the GPU check cannot rot between GPU
runs. The greedy comparisons and the W1 load must pass; the server must leave no shared memory behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"))
    # Its own process group: on a timeout the whole script gets SIGTERM, and its server stage stops its server.
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--device", "cpu"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=380)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=40)
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").is_file() else output
    assert proc.returncode == 0, summary
    assert summary.rstrip().endswith("PASS"), summary
    assert "(a) kernel tests: " in summary and "tests collected" in summary, summary
    for stage in ("b", "c"):
        report = json.loads((out / f"stage_{stage}.json").read_text())
        assert report["ok"] is True, (stage, report)
    runner = json.loads((out / "stage_b.json").read_text())
    assert all(r["steps"] == runner["decode_steps"] + 1 for r in runner["requests"])
    server = json.loads((out / "stage_c.json").read_text())
    assert len(server["prompts"]) == 16 and server["shm_left"] == [] and server["w1_completed"] == 4
    timings = json.loads((out / "stage_d.json").read_text())
    assert [(d["batch"], d["context"]) for d in timings["decode"]] == [(1, 64), (1, 128), (4, 64), (4, 128)]
    assert all(d["step_ms"] > 0 and d["tok_s"] > 0 for d in timings["decode"])
    assert timings["prefill"]["tokens"] == 128 and timings["triton_compiles_after_warm_up"] == []
