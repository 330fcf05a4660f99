"""scripts/performance_report.py on a compare_vllm.sh-shaped JSON: the Markdown table holds each series' medians, and
each SVG plot draws one line per series through its sweep points, in order of concurrency."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "performance_report.py"


def _side(tok_s: float, itl: float) -> dict:
    sweep = {f"C{c}": {"median": {"output tok/s": tok_s * c, "ITL p50 ms": itl + c}} for c in (16, 1, 4)}
    return {"workloads": {"W1": {"median": {"output tok/s": tok_s, "TPOT mean ms": 100.0}}, **sweep}}


def test_table_and_plots(tmp_path):
    data = tmp_path / "run.json"
    data.write_text(json.dumps({"sides": {"vllm": _side(10.0, 20.0), "lightserve": _side(12.5, 15.0)}}))
    out = subprocess.run([sys.executable, str(SCRIPT), "--series", f"vLLM={data}:vllm",
                          "--series", f"lightserve={data}:lightserve", "--plots", str(tmp_path / "plots"),
                          "--name", "cpu"], capture_output=True, text=True, check=True).stdout
    assert "| W1 | output tok/s | 10.0 | 12.5 |" in out and "| W1 | TPOT mean ms | 100.0 | 100.0 |" in out
    for name in ("cpu_throughput.svg", "cpu_itl.svg"):
        svg = (tmp_path / "plots" / name).read_text()
        lines = re.findall(r'<polyline points="([^"]+)"', svg)
        assert len(lines) == 2 and svg.count("<circle") == 6
        for line in lines:
            xs = [float(p.split(",")[0]) for p in line.split()]
            assert xs == sorted(xs) and len(set(xs)) == 3
    # the faster series' throughput line lies above (smaller y) at every point
    throughput = (tmp_path / "plots" / "cpu_throughput.svg").read_text()
    vllm_line, ls_line = re.findall(r'<polyline points="([^"]+)"', throughput)
    assert all(float(b.split(",")[1]) < float(a.split(",")[1]) for a, b in zip(vllm_line.split(), ls_line.split()))


def test_unknown_side_is_named(tmp_path):
    data = tmp_path / "run.json"
    data.write_text(json.dumps({"sides": {"vllm": _side(10.0, 20.0)}}))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--series", f"x={data}:lightserve"], capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "has no side 'lightserve' (it has vllm)" in proc.stderr
