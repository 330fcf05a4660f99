"""scripts/profile_step.py on the real model: a decode profile prints the torch.profiler table, the C kernels timed
without the profiler as shares of the step, and the step against its physical floor; a prefill profile the same
kernel times against its forward."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "profile_step.py"), *args],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _timed_rows(out):
    """The rows of the 'C kernels timed without the profiler' table: {group: (ms, percent)}."""
    table = out.split("C kernels timed without the profiler", 1)[1].splitlines()[1:]
    rows = {}
    for line in table:
        m = re.match(r"\s{4}(\S.*?)\s+([\d.]+) ms\s+([\d.]+)%$", line)
        if not m:
            break
        rows[m[1]] = (float(m[2]), float(m[3]))
    return rows


def test_decode_profile_times_the_c_kernels(tmp_path):
    # bf16 at batch 4: every linear runs in C on every CPU (the pair kernels take up to 4 rows everywhere).
    out = _run(tmp_path, "--batch", "4", "--context", "64", "--steps", "4", "--dtype", "bfloat16")
    assert "forward by op group (last step, torch.profiler self CPU time)" in out
    assert "median of 3 steps" in out  # the profiled last step is left out
    rows = _timed_rows(out)
    assert {"linear (GEMM)", "attention", "norms", "rest of the forward"} <= set(rows)
    assert "linear (GEMM, torch)" not in rows  # the C linears' labels are not taken for torch's GEMMs
    assert all(ms >= 0 for ms, _ in rows.values()) and rows["linear (GEMM)"][0] > 0
    # The kernels' medians fit in the forward's (a call counted twice, or timed across the whole step, would not).
    assert rows["rest of the forward"][0] >= 0
    assert sum(pct for _, pct in rows.values()) < 100  # shares of the whole step, of which the forward is part
    assert re.search(r"this step: [\d.]+ ms = [\d.]+x the floor", out)
    # The floor's GEMM rate is the better of the benchmark's and the rate the step's own timed linears reached.
    rate, bench, own = map(float, re.search(r"GFLOP at (\d+) GFLOP/s \(the better of: .* (\d+), the step's own "
                                            r"linears (\d+)\)", out).groups())
    assert rate == max(bench, own) and own > 0


def test_prefill_profile_times_the_c_kernels(tmp_path):
    out = _run(tmp_path, "--batch", "1", "--context", "64", "--prefill", "--dtype", "float32")
    rows = _timed_rows(out)
    assert rows["linear (GEMM)"][0] > 0 and rows["attention"][0] > 0
    assert "linear (GEMM, torch)" not in rows
    assert rows["rest of the forward"][0] >= 0  # the kernels fit in the one forward they were timed in
