#!/usr/bin/env python3
"""docs/performance.md's figures from scripts/compare_vllm.sh's JSON: the W1/W2/W3 table of each series and two plots
of the concurrency sweep (workloads C1, C4, ...): output tok/s against concurrency and inter-token latency (p50)
against concurrency, one line per series. The plots are SVG written here (no plotting library).

    scripts/compare_vllm.sh --dtype float32 --runs 1 --workloads W1,W2,W3,C1,C4,C16,C64 --out results/zen3.json
    LIGHTSERVE_EXTRA_ARGS="--kv_cache_dtype int8" scripts/compare_vllm.sh --only lightserve --dtype float32 \\
        --runs 1 --workloads W1,W2,W3,C1,C4,C16,C64 --out results/zen3_int8.json
    python scripts/performance_report.py --series "vLLM=results/zen3.json:vllm" \\
        --series "lightserve=results/zen3.json:lightserve" \\
        --series "lightserve, int8 KV=results/zen3_int8.json:lightserve" --plots docs/performance --name zen3

A series is LABEL=FILE:SIDE (SIDE: vllm or lightserve, a side of that file). Writes PLOTS/NAME_throughput.svg and
PLOTS/NAME_itl.svg and prints the table in Markdown.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

TABLE = [("W1", "output tok/s"), ("W1", "TPOT mean ms"), ("W1", "TTFT mean ms"), ("W2", "ITL p50 ms"),
         ("W2", "TTFT p50 ms"), ("W3", "TTFT p50 ms"), ("W3", "output tok/s")]
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
WIDTH, HEIGHT, PAD = 560, 360, 56


def load_series(spec: str) -> tuple[str, dict]:
    """LABEL=FILE:SIDE -> (label, that side's entry of the JSON: its workloads' medians and where it ran)."""
    label, _, rest = spec.partition("=")
    path, _, side = rest.rpartition(":")
    if not (label and path and side):
        raise SystemExit(f"--series {spec!r}: expected LABEL=FILE:SIDE")
    sides = json.loads(Path(path).read_text())["sides"]
    if side not in sides:
        raise SystemExit(f"--series {spec!r}: {path} has no side {side!r} (it has {', '.join(sides)})")
    return label, sides[side]


def sweep(entry: dict, metric: str) -> list[tuple[int, float]]:
    """(concurrency, median of `metric`) of the entry's C<n> workloads, by concurrency."""
    points = [(int(m.group(1)), w["median"].get(metric)) for name, w in entry["workloads"].items()
              if (m := re.fullmatch(r"C(\d+)", name))]
    return sorted((c, v) for c, v in points if v is not None)


def svg_plot(title: str, y_label: str, series: dict[str, list[tuple[int, float]]]) -> str:
    """A line per series over a log2 concurrency axis, y from 0 to the largest value."""
    xs = sorted({c for pts in series.values() for c, _ in pts})
    if not xs:
        raise SystemExit("no sweep points (workloads C1, C4, ...) in the series")
    y_max = max(v for pts in series.values() for _, v in pts) * 1.1
    lo, hi = math.log2(xs[0]), math.log2(xs[-1]) if xs[-1] > xs[0] else math.log2(xs[0]) + 1

    def px(c: float) -> float:
        return PAD + (math.log2(c) - lo) / (hi - lo) * (WIDTH - 2 * PAD)

    def py(v: float) -> float:
        return HEIGHT - PAD - v / y_max * (HEIGHT - 2 * PAD)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>',
           f'<text x="{WIDTH / 2}" y="{HEIGHT - 16}" text-anchor="middle">requests in flight</text>',
           f'<text x="16" y="{HEIGHT / 2}" text-anchor="middle" '
           f'transform="rotate(-90 16 {HEIGHT / 2})">{y_label}</text>']
    for c in xs:
        out.append(f'<text x="{px(c):.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle">{c}</text>')
    for i in range(5):
        v = y_max / 1.1 * i / 4
        out.append(f'<text x="{PAD - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{PAD}" y1="{py(v):.1f}" x2="{WIDTH - PAD}" y2="{py(v):.1f}" stroke="#ddd"/>')
    for k, (label, pts) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        path = " ".join(f"{px(c):.1f},{py(v):.1f}" for c, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{px(c):.1f}" cy="{py(v):.1f}" r="3" fill="{color}"/>' for c, v in pts]
        out.append(f'<text x="{PAD + 10}" y="{PAD + 14 * k}" fill="{color}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def markdown_table(series: dict[str, dict]) -> str:
    labels = list(series)
    lines = ["| workload | metric | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for w, metric in TABLE:
        vals = [series[s]["workloads"].get(w, {}).get("median", {}).get(metric) for s in labels]
        if all(v is None for v in vals):
            continue
        lines.append(f"| {w} | {metric} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", action="append", required=True, help="LABEL=FILE:SIDE (repeat)")
    ap.add_argument("--plots", default="docs/performance", help="folder the SVG files go to")
    ap.add_argument("--name", default="sweep", help="the plots' file name prefix")
    args = ap.parse_args(argv)
    series = dict(load_series(s) for s in args.series)
    folder = Path(args.plots)
    folder.mkdir(parents=True, exist_ok=True)
    for suffix, metric, title, y_label in (
            ("throughput", "output tok/s", "Output tokens per second", "output tok/s"),
            ("itl", "ITL p50 ms", "Inter-token latency, median", "ms")):
        svg = svg_plot(title, y_label, {label: sweep(entry, metric) for label, entry in series.items()})
        (folder / f"{args.name}_{suffix}.svg").write_text(svg)
    print(markdown_table(series))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
