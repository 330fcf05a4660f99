"""Micro benchmark of the linears over GGML block weights (kernels/quant_linear.py, quant_linear.c), with float32
activations (weight-only) and with int8 ones (int8_dot: quant_linear_q8, its GEMV to M = 4 and its GEMM above),
against the float32 GEMM on packed panels (kernels.linear's pack_linear_weight + linear_cpu) and the bf16 prepacked
path (prepack_weight + linear), per weight shape, block type and row count M: median ms a call, GB/s of the weight
bytes each path reads, GFLOP/s.
Weights come from memory, as in a decode step: each path cycles through distinct copies of a shape's weight, at
least --pool_mb of them (default twice the L3's size), past the L3.

    python scripts/bench_quant_linear.py [--models smollm2 llama1b] [--types Q4_1 Q8_0 Q4_K Q6_K] [--rows 1 4 16 64]
    python scripts/bench_quant_linear.py --no_amx_too   # the int8 path also in this CPU's build without AMX tiles

Timings vary run to run on a shared machine: compare paths within one run. Prints the CPU model first.
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import subprocess
import time

import torch

from lightserve.kernels.cpu import NO_AMX, build, library, load
from lightserve.kernels.linear import linear, linear_cpu, pack_linear_weight, prepack_weight
from lightserve.kernels.quant_linear import (
    BLOCK_SHAPES,
    GGMLType,
    QuantLinear,
    quant_linear,
    quant_linear_cpu,
    quant_tensor,
)

# name -> [(label, N, K, block type or None for the run's --types)]
SHAPES = {
    "smollm2": [("qkv", 960, 576, None), ("o", 576, 576, None), ("gate_up", 3072, 576, None),
                ("down", 576, 1536, None), ("lm_head", 49152, 576, GGMLType.Q8_0)],
    "llama1b": [("q/o", 2048, 2048, None), ("k/v", 512, 2048, None), ("gate/up", 8192, 2048, None),
                ("down", 2048, 8192, None), ("lm_head", 128256, 2048, GGMLType.Q6_K)],  # Q4_K_M's tied Q6_K
}


def random_blocks(qtype: GGMLType, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, K / QK * block_bytes] random quants with small finite scales (only their bytes matter for timing)."""
    qk, nb = BLOCK_SHAPES[qtype]
    blocks = torch.randint(0, 256, (n * (k // qk), nb), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(blocks.shape[0], 2, generator=gen) * 0.01).half().view(torch.uint8)  # [blocks, 4]
    if qtype == GGMLType.Q6_K:
        blocks[:, 208:210] = scale[:, :2]
    elif qtype == GGMLType.Q8_K:
        blocks[:, :4] = scale.view(torch.float32).abs().view(torch.uint8)
    else:  # d (and the min or dmin) lead the block
        blocks[:, :4] = scale
    return blocks.reshape(n, -1)


def l3_bytes() -> int:
    """The last-level cache's size as Linux reports it for CPU 0 (0 where it does not): a 64 MB pool sits inside the
    L3 of some hosts (an AMX Xeon's reads 480 MB), where "from memory" would be partly cache-served."""
    try:
        size = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return 0
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
    return int(size.rstrip("KMG")) * unit


def pool(make, nbytes: int, pool_bytes: int) -> list:
    """Distinct copies of one weight, enough that a pass over them streams pool_bytes from memory."""
    first = make()
    return [first] + [make() for _ in range(-(-pool_bytes // nbytes) - 1)]


def median_call_s(paths: dict[str, tuple], reps: int) -> dict[str, float]:
    """name -> (fn, copies, x): the median over `reps` passes of one call's seconds, each pass a call on every copy;
    the paths alternate pass by pass, so a busy machine slows them alike."""
    for fn, weights, x in paths.values():
        for w in weights[:2]:
            fn(x, w)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(reps):
        for name, (fn, weights, x) in paths.items():
            t = time.perf_counter()
            for w in weights:
                fn(x, w)
            times[name].append((time.perf_counter() - t) / len(weights))
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q4_K", "Q6_K"],
                        choices=[t.name for t in BLOCK_SHAPES])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pool_mb", type=int, default=None,
                        help="MB each path cycles through per pass (default: twice the L3, at least 64; 0: one copy, "
                             "cache-resident where it fits)")
    parser.add_argument("--no_bf16", action="store_true", help="leave out the bf16 prepacked path")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no_amx_too", action="store_true",
                        help="time the int8 path also in the native build without AMX tiles (-mno-amx-*), and the "
                             "ratio of the served build's time to it")
    args = parser.parse_args()
    assert library() is not None, "no C kernel library here"
    args.no_amx_lib = load(build(NO_AMX)) if args.no_amx_too else None
    if args.threads:
        torch.set_num_threads(args.threads)
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
        platform.processor())
    pool_mb = args.pool_mb if args.pool_mb is not None else max(64, 2 * l3_bytes() >> 20)
    print(f"CPU: {model}, torch threads {torch.get_num_threads()}, weights cycled through {pool_mb} MB a path")
    gen, pool_bytes = torch.Generator().manual_seed(0), pool_mb << 20
    print(f"{'shape':>16s} {'type':>5s} {'M':>3s} | {'quant ms':>8s} {'GB/s':>6s} {'GFLOP/s':>7s} | "
          f"{'int8 ms':>8s} {'GB/s':>6s} | {'f32 ms':>8s} {'GB/s':>6s} {'GFLOP/s':>7s} | {'bf16 ms':>8s} | "
          f"quant/f32 int8/f32" + (" | no-AMX int8 ms  int8/no-AMX" if args.no_amx_too else ""))
    for model_name in args.models:
        for label, n, k, fixed in SHAPES[model_name]:
            types = [fixed] if fixed is not None else [GGMLType[t] for t in args.types]
            types = [t for t in types if k % BLOCK_SHAPES[t][0] == 0]  # K = 576 takes no 256-blocks
            time_shape(f"{model_name} {label}", n, k, types, args, gen, pool_bytes)


def time_shape(name: str, n: int, k: int, types: list[GGMLType], args: argparse.Namespace, gen: torch.Generator,
               pool_bytes: int) -> None:
    """One [N, K] weight: the float32 and bf16 paths once per M, each block type against them."""
    dense = torch.randn(n, k, generator=gen) * 0.05
    f32 = pool(lambda: pack_linear_weight(dense), n * k * 4, pool_bytes)
    bf16 = [] if args.no_bf16 else pool(lambda: prepack_weight(dense.bfloat16()), n * k * 2, pool_bytes)
    quants = {t: pool(lambda t=t: quant_tensor(t, random_blocks(t, n, k, gen), k),
                      n * k // BLOCK_SHAPES[t][0] * BLOCK_SHAPES[t][1], pool_bytes) for t in types}
    for m in args.rows:
        x = torch.randn(m, k, generator=gen)
        flop = 2 * m * n * k
        paths = {"f32": (linear_cpu, f32, x), **{t.name: (quant_linear, ws, x) for t, ws in quants.items()},
                 **{f"{t.name} int8": (quant_linear, [dataclasses.replace(w, int8_dot=True) for w in ws], x)
                    for t, ws in quants.items()}}
        if bf16:
            paths["bf16"] = (linear, bf16, x.bfloat16())
        if args.no_amx_lib is not None:
            paths.update({f"{t.name} int8 no-AMX": (
                lambda x, w: quant_linear_cpu(x, w, lib=args.no_amx_lib), [dataclasses.replace(w, int8_dot=True)
                                                                           for w in ws], x)
                for t, ws in quants.items()})
        sec = median_call_s(paths, args.reps)
        f32_s, bf16_s = sec["f32"], sec.get("bf16", float("nan"))
        for t, ws in quants.items():
            w: QuantLinear = ws[0]
            q_s, i_s = sec[t.name], sec[f"{t.name} int8"]
            print(f"{name:>16s} {t.name:>5s} {m:3d} | {1e3 * q_s:8.3f} {w.nbytes / q_s / 1e9:6.1f} "
                  f"{flop / q_s / 1e9:7.1f} | {1e3 * i_s:8.3f} {w.nbytes / i_s / 1e9:6.1f} | "
                  f"{1e3 * f32_s:8.3f} {n * k * 4 / f32_s / 1e9:6.1f} "
                  f"{flop / f32_s / 1e9:7.1f} | {1e3 * bf16_s:8.3f} | {q_s / f32_s:9.2f} {i_s / f32_s:8.2f}"
                  + (f" | {1e3 * sec[t.name + ' int8 no-AMX']:14.3f} {i_s / sec[t.name + ' int8 no-AMX']:12.2f}"
                     if args.no_amx_lib is not None else ""), flush=True)


if __name__ == "__main__":
    main()
