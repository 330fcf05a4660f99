"""scripts/bench_cpu_kernels.py: --linears (both dtypes as served and through oneDNN, and the FMA peak beside them)
and the decode attention mode (each rep's GB/s against the bandwidth read right after it)."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from lightserve.kernels.linear import onednn_bf16_available
from tests.kernels.kernel_cases import DECODE_TUNINGS

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
    assert all(r["gflops_served"] > 0 and r["gflops_baseline"] > 0 for r in rows.values())
    # oneDNN where it has the dtype; on an AVX2-only CPU it has no bf16 path and torch's F.linear stands in.
    bf16_baseline = "oneDNN" if onednn_bf16_available() else "F.linear"
    assert all(r["baseline"] == (bf16_baseline if op == "linear_bfloat16" else "oneDNN") for (op, _), r in rows.items())
    # Two FLOPs an FMA, every vector lane: a peak below the served GEMM's rate would be a wrong measurement.
    peak = report["fma_peak_gflops"]
    assert peak is not None and peak > max(r["gflops_served"] for r in rows.values() if r["op"] == "linear_float32")
    assert "float32 FMA peak" in run.stdout


def test_decode_attention_reports_its_share_of_the_bandwidth_read_beside_it(tmp_path):
    """The decode mode: the kernel called with prepared arguments (checked against its wrapper inside the script),
    a bandwidth reading after every rep, and the share taken against those readings."""
    out = tmp_path / "decode.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cpu_kernels.py"), "--shapes", "2x96", "1x300",
                          "--dtypes", "bfloat16", "float32", "--layers", "2", "--reps", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["dtype"], r["batch"], r["context"]): r for r in report["results"]}
    assert set(rows) == {(d, b, c) for d in ("bfloat16", "float32") for b, c in ((2, 96), (1, 300))}
    for r in rows.values():
        assert len(r["read_gbps"]) == len(r["rep_ms_per_layer"]) == 3 and all(bw > 0 for bw in r["read_gbps"])
        assert r["ms_per_layer"] == pytest.approx(statistics.median(r["rep_ms_per_layer"]))
        kv_gb = 2 * r["batch"] * r["context"] * 3 * 64 * (2 if r["dtype"] == "bfloat16" else 4) / 1e9
        assert r["gbps"] == pytest.approx(kv_gb / (r["ms_per_layer"] / 1e3))
        # each rep's GB/s over the reading taken right after it, the median of those
        shares = [kv_gb / (ms / 1e3) / bw for ms, bw in zip(r["rep_ms_per_layer"], r["read_gbps"], strict=True)]
        assert r["share_of_bandwidth"] == pytest.approx(statistics.median(shares)) and r["share_of_bandwidth"] > 0
        assert r["kv_layout"] == "head-major"  # as a CPU server allocates its KV cache
    assert len(report["read_gbps_readings"]) == 3 * len(rows)


@pytest.mark.parametrize("token_major", [False, True])
def test_prefill_attention_reports_its_rate_over_either_kv_layout(tmp_path, token_major):
    """--prefill: the C prefill attention over a shared cached prefix, over the head-major KV cache a CPU server
    allocates or (--token-major) a row of all heads per token."""
    out = tmp_path / "prefill.json"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_cpu_kernels.py"), "--prefill", "2x40+24",
                          "--dtypes", "bfloat16", "--layers", "2", "--reps", "1", "--json", str(out),
                          *(["--token-major"] if token_major else [])],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["op"] == "prefill_attention" and row["shape"] == "2x40+24" and row["gflops"] > 0
    assert row["kv_layout"] == ("token-major" if token_major else "head-major")


def test_define_times_other_builds_in_turn_and_rejects_what_it_cannot_build(tmp_path):
    """--define: each build with other compile-time choices of decode attention is checked against the torch reference
    inside the script, then timed in turns with the plain build; a name the source does not take is a usage error.
    With --cached every request reads the same rows; --token-major lays the KV out a row of all heads per token."""
    out = tmp_path / "define.json"
    script = str(REPO / "scripts" / "bench_cpu_kernels.py")
    defines = [[f"{k}={v}" for k, v in tuning.items()] for tuning in DECODE_TUNINGS]  # the kernel tests' builds
    run = subprocess.run([sys.executable, script, "--shapes", "2x96", "--dtypes", "bfloat16", "--layers", "2",
                          "--reps", "2", "--cached", "--token-major", "--define", *(",".join(d) for d in defines),
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"native", *("native+" + "+".join(d) for d in defines)}
    assert all(len(r["rep_ms_per_layer"]) == 2 and r["gbps"] > 0 and r["cached"] and r["kv_layout"] == "token-major"
               for r in rows.values())
    assert "x native's time" in run.stdout
    bad = subprocess.run([sys.executable, script, "--shapes", "2x96", "--define", "BLOCK=16"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert bad.returncode == 2 and "BLOCK: not a tunable" in bad.stderr
