"""scripts/bench_cpu_kernels.py --linears: both dtypes as served and through oneDNN, and the FMA peak beside them."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_linears_report_both_dtypes_and_the_fma_peak(tmp_path):
    out = tmp_path / "linears.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cpu_kernels.py"), "--linears", "1", "8",
                          "--layers", "1", "--reps", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["op"], r["rows"]): r for r in report["results"]}
    assert set(rows) == {(op, m) for op in ("linear_bfloat16", "linear_float32") for m in (1, 8)}
    assert all(r["gflops_served"] > 0 and r["gflops_onednn"] > 0 for r in rows.values())
    # Two FLOPs an FMA, every vector lane: a peak below the served GEMM's rate would be a wrong measurement.
    peak = report["fma_peak_gflops"]
    assert peak is not None and peak > max(r["gflops_served"] for r in rows.values() if r["op"] == "linear_float32")
    assert "float32 FMA peak" in run.stdout
