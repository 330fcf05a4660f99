#!/usr/bin/env python3
"""CPU kernels against the machine's own memory bandwidth, measured in the same run.

It times the C decode attention over a KV cache spread across as many layers as the model has, so that every
layer's K/V comes from memory as in a real step, not from the last-level cache, and reads the streaming read
bandwidth (torch.sum over a 256 MB buffer, all threads) after every timed rep. It prints each shape's time per
layer, the KV bytes it read, its GB/s, and that as a share of the bandwidth read beside it. --prefill and --greedy
time kernels that compute more than they read instead (ms, and GFLOP/s for prefill attention).

    python scripts/bench_cpu_kernels.py                          # SmolLM2's heads, bf16 and float32 KV
    python scripts/bench_cpu_kernels.py --kv-dtypes auto int8 fp8_e4m3 fp8_e5m2   # and the same over 8-bit KV
    python scripts/bench_cpu_kernels.py --heads 32 8 128 --layers 8 --dtypes bfloat16
    python scripts/bench_cpu_kernels.py --variants native avx2 portable   # the same source, narrower builds
    python scripts/bench_cpu_kernels.py --cached --shapes 64x384  # the same kernel with its KV in cache
    python scripts/bench_cpu_kernels.py --define PF_LOCALITY=-1 PF_LOCALITY=3,PF_DIST=64   # other compile-time choices
    python scripts/bench_cpu_kernels.py --linears 1 4 8 16 64 512   # linears as served against oneDNN, FMA peak
    python scripts/bench_cpu_kernels.py --prefill 15x48+1024 1x512 --variants native avx2   # prefill attention
    python scripts/bench_cpu_kernels.py --greedy 64x49152        # greedy sampling's argmax + logsumexp

The variants (lightserve.kernels.cpu.BUILD_VARIANTS): `native` is the serving build (-march=native: AVX-512
where the CPU has it), `avx512` the same source without AVX512-BF16 (what Skylake-SP to Ice Lake Xeons run),
`avx2` with AVX-512 off (what an AVX2-only CPU runs), `portable` with AVX2 and FMA off too.
--define adds builds of each variant with other values of decode_attention.c's compile-time choices
(lightserve.kernels.cpu.TUNABLES: the prefetch hint and distance, the head-packing threshold); the decode timings take
turns between the builds rep by rep, and each build's output is checked against the torch reference first.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightserve.engine.host_tuning import preload_tcmalloc
from lightserve.kernels.cpu import BUILD_VARIANTS, TUNABLES, c_compiler, library, variant_library
from lightserve.kernels.decode_attention import decode_attention_c_args, decode_attention_ref
from lightserve.kernels.kv_store import FP8_MAX, quantize_kv_ref
from lightserve.kernels.linear import cpu_pack_for, linear, onednn_bf16_available, pairs_take_every_m
from lightserve.kernels.prefill_attention import prefill_attention_cpu
from lightserve.model_infer.sampler import greedy_cpu

SCRIPTS = Path(__file__).resolve().parent

# (batch, context): a full decode batch, a mid batch of long requests, one long request.
DECODE_SHAPES = [(64, 384), (16, 1100), (1, 2000)]
# --kv-dtypes: the KV cache formats decode attention reads, as --kv_cache_dtype spells them; auto = the activation
# dtype (--dtypes).
KV_DTYPES = {"auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cpu_caption() -> str:
    """The CPU model and its vector flags (from lscpu), for every figure's caption."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wide = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{fields.get('Model name', '?').strip()}, {torch.get_num_threads()} threads, flags: {' '.join(wide)}"


def read_bandwidth(mb: int = 256, reps: int = 15) -> float:
    """Streaming read GB/s: median torch.sum over a float32 buffer far larger than the caches."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def kv_layout(kv: torch.Tensor, token_major: bool) -> torch.Tensor:
    """kv [layers, rows, Hk, D] as a CPU KVCache lays it out (model_infer/kv_cache.py): the same values as a view
    of head-major storage [layers, Hk, rows, D]; with token_major (--token-major) as it is."""
    return kv if token_major else kv.transpose(1, 2).contiguous().transpose(1, 2)


def decode_case(batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, layers: int,
                scatter: bool, seed: int = 0, cached: bool = False, token_major: bool = False,
                kv_dtype: torch.dtype | None = None) -> dict:
    """KV caches for `layers` layers, each request's tokens in its own run of rows (as a fresh server
    allocates them) or scattered (--scatter); q and the request tables. cached (--cached): every request reads the
    same `context` rows (`layers` x context rows in all: 9 MB at SmolLM2's 30 layers x 384 in bf16, which the caches
    hold), so the kernel runs without waiting on memory. K/V in kv_layout's layout, stored as kv_dtype (None: dtype;
    int8 or fp8: quantized as store_kv writes them, with their scales per layer in k_scale / v_scale)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    rows = context if cached else batch * context
    kv_dtype = kv_dtype or dtype
    scales = {}
    kv = []
    for name in ("k_scale", "v_scale"):
        x = torch.randn(layers * rows, num_kv_heads, head_dim, generator=gen)  # [layers * rows, Hk, D]
        stored, row_scales = quantize_kv_ref(x, kv_dtype)  # fp8's per-tensor scale: 1.0, as without a checkpoint's
        kv.append(kv_layout(stored.view(layers, rows, num_kv_heads, head_dim), token_major))
        # int8: [layers, rows, Hk] float32, token-major whatever the cache's layout; fp8: 1.0; a float cache: None
        scales[name] = list(row_scales.view(layers, rows, num_kv_heads).unbind(0)) if row_scales is not None \
            else [1.0 if kv_dtype in FP8_MAX else None] * layers
    k, v = kv
    order = torch.randperm(rows, generator=gen) if scatter else torch.arange(rows)
    req_to_token = (order.repeat(batch) if cached else order).view(batch, context).to(torch.int32).contiguous()
    return {
        "k": k, "v": v, **scales, "req_to_token": req_to_token,
        "req_rows": torch.arange(batch, dtype=torch.int32),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32),
        "q": torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype),
    }


def median_per_layer(attend, layers: int, reps: int) -> float:
    """Median seconds per layer of attend(layer) (None: the C kernel declined): each rep runs every layer
    once, in order, like a forward, so each layer's K/V comes from memory."""
    def one_pass() -> None:
        for i in range(layers):
            assert attend(i) is not None, "the C kernel declined this shape"

    one_pass()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        one_pass()
        times.append((time.perf_counter() - t) / layers)
    return statistics.median(times)


def time_decode(case: dict, libs: dict, reps: int) -> dict[str, tuple[float, list[tuple[float, float]]]]:
    """For each build in libs (name -> library): (median seconds per layer of the C decode attention, each rep's
    (seconds per layer, the read bandwidth in GB/s read right after it)). The builds take turns rep by rep, so a
    comparison between them spans the same minutes (this VM's read bandwidth read 24-50 GB/s within one minute). The
    kernel is called with its arguments prepared once per layer, as the one-call driver calls it from C: the Python
    wrapper's conversions, checks and output allocation (about 6 us a call, Zen 4) are not the kernel's. Each build's
    output for the last layer is checked against the torch reference (kernels/decode_attention.py), within bf16's
    rounding where the KV is bf16, so a build with other compile-time choices (--define) is checked too."""
    q = case["q"]
    out = torch.empty_like(q)  # [B, Hq, D]
    scale = q.shape[-1] ** -0.5
    calls = [decode_attention_c_args(q, case["k"][i], case["v"][i], case["req_to_token"], case["req_rows"],
                                     case["seq_lens"], scale, out, k_scale=case["k_scale"][i],
                                     v_scale=case["v_scale"][i])
             for i in range(case["k"].shape[0])]
    want = decode_attention_ref(q, case["k"][-1], case["v"][-1], case["req_to_token"], case["req_rows"],
                                case["seq_lens"], int(case["seq_lens"].max()), scale, k_scale=case["k_scale"][-1],
                                v_scale=case["v_scale"][-1]).float()
    tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-5  # tests/kernels/kernel_cases.py's TOL

    def one_pass(lib) -> float:
        t = time.perf_counter()
        for c in calls:
            assert lib.decode_attention(*c) == 0, "the C kernel declined this shape"
        return (time.perf_counter() - t) / len(calls)

    pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
    for name, lib in libs.items():
        one_pass(lib)  # warm: the first call of a build pays its loading
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")
    for _ in range(reps):
        for name, lib in libs.items():
            sec = one_pass(lib)
            pairs[name].append((sec, read_bandwidth(reps=3)))
    return {name: (statistics.median(s for s, _ in p), p) for name, p in pairs.items()}


def prefill_case(batch: int, extend: int, prefix: int, heads: tuple[int, int, int], dtype: torch.dtype,
                 layers: int, seed: int = 0, token_major: bool = False) -> dict:
    """`batch` requests of `extend` new tokens over one shared `prefix` (already in the cache, as the radix
    cache shares it), KV for `layers` layers in kv_layout's layout; the FLOPs of the step's attention (QK and PV,
    causal)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    rows = prefix + batch * extend
    req_to_token = torch.empty(batch, prefix + extend, dtype=torch.int32)
    for b in range(batch):
        req_to_token[b, :prefix] = torch.arange(prefix)
        req_to_token[b, prefix:] = prefix + b * extend + torch.arange(extend)
    keys_seen = batch * sum(prefix + i + 1 for i in range(extend))  # (query token, key) pairs
    k, v = (kv_layout(torch.randn(layers, rows, num_kv_heads, head_dim, generator=gen).to(dtype), token_major)
            for _ in range(2))
    return {
        "k": k,
        "v": v,
        "q": torch.randn(batch * extend, num_heads, head_dim, generator=gen).to(dtype),
        "meta": (req_to_token, torch.arange(batch, dtype=torch.int32), torch.arange(batch, dtype=torch.int32) * extend,
                 torch.full((batch,), prefix, dtype=torch.int32), torch.full((batch,), extend, dtype=torch.int32)),
        "flops": 4 * keys_seen * num_heads * head_dim,
    }


def time_prefill(case: dict, lib, reps: int) -> float:
    scale = case["q"].shape[-1] ** -0.5
    return median_per_layer(lambda i: prefill_attention_cpu(case["q"], case["k"][i], case["v"][i], *case["meta"], scale,
                                                            lib=lib),
                            case["k"].shape[0], reps)


def time_greedy(rows: int, vocab: int, lib, reps: int) -> float:
    """Median seconds of greedy sampling's argmax + logsumexp over [rows, vocab] float32 logits, each call on
    logits just written (as the lm_head leaves them)."""
    src = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        logits.copy_(src)
        t = time.perf_counter()
        assert greedy_cpu(logits, lib=lib) is not None
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def rerun_under_tcmalloc() -> None:
    """Re-exec this script with tcmalloc preloaded (read only at exec), as the server's CPU workers run, unless it
    already is or there is none: with glibc's malloc each large output (a prefill chunk's activations) is a fresh
    mapping whose pages fault in on first write, on both sides of a comparison. profile_step.py uses it too."""
    before = os.environ.get("LD_PRELOAD", "").split(":")
    if (path := preload_tcmalloc()) and path not in before:
        os.execv(sys.executable, [sys.executable, *sys.argv])


# SmolLM2's projections (N x K) and its lm_head: what one decode or prefill step multiplies, per layer and once.
LINEAR_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def fma_peak(threads: int) -> float | None:
    """GFLOP/s of float32 vector FMAs on `threads` threads (scripts/fma_peak.c, built with the kernels' flags), or
    None where it cannot be built here. A GEMM-bound step's hardware ceiling: each FMA is two FLOPs."""
    cc = c_compiler()
    if cc is None:
        return None
    exe = Path(tempfile.mkdtemp(prefix="fma_peak_")) / "fma_peak"
    try:
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-o", str(exe), str(SCRIPTS / "fma_peak.c")],
                       check=True, capture_output=True, timeout=120)
        return float(subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True,
                                    timeout=300).stdout.split()[0])
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        shutil.rmtree(exe.parent, ignore_errors=True)


def time_linears(rows: list[int], layers: int, reps: int, dtype: torch.dtype) -> list[dict]:
    """Linears of every row count in `dtype`: as served (kernels.linear on the layout the model packs at load:
    linear.c's panels for float32, prepack_weight's for bf16) against oneDNN's prepacked GEMM (torch's F.linear for
    bf16 where oneDNN has no bf16 path: an AVX2-only CPU), over `layers` layers of distinct weights plus the lm_head
    (weights from memory, as in a step), the two alternated rep by rep. GFLOP/s of the whole pass, medians."""
    gen = torch.Generator().manual_seed(0)
    raw = {name: [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for _ in range(layers)]
           for name, (n, k) in LINEAR_SHAPES.items()}
    raw["lm_head"] = [(torch.randn(*LM_HEAD, generator=gen) * 0.05).to(dtype)]
    pack = cpu_pack_for(raw["lm_head"][0]) or (lambda w: w)  # what the model's load does (plain F.linear: none)
    served = {name: [pack(w) for w in ws] for name, ws in raw.items()}
    if dtype == torch.float32 or onednn_bf16_available():
        baseline = "oneDNN"
        other = {name: [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for name, ws in raw.items()}

        def run_one(x: torch.Tensor, w: torch.Tensor) -> None:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:
        baseline, other, run_one = "F.linear", raw, F.linear
    shapes = {name: (ws[0].shape[1], sum(w.numel() for w in ws)) for name, ws in raw.items()}  # K, weights
    del raw
    results = []
    for m in rows:
        xs = {name: torch.randn(m, k, generator=gen).to(dtype) for name, (k, _) in shapes.items()}
        flops = 2 * m * sum(numel for _, numel in shapes.values())

        def run_served(xs: dict = xs) -> None:
            for name, ws in served.items():
                for w in ws:
                    linear(xs[name], w)

        def run_other(xs: dict = xs) -> None:
            for name, ws in other.items():
                for w in ws:
                    run_one(xs[name], w)

        times = {"served": [], "other": []}
        run_served(), run_other()
        for _ in range(reps):
            for key, fn in (("served", run_served), ("other", run_other)):
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
        sec = {key: statistics.median(v) for key, v in times.items()}
        name = str(dtype).removeprefix("torch.")
        results.append({"op": f"linear_{name}", "rows": m, "layers": layers, "baseline": baseline,
                        "ms_served": 1e3 * sec["served"], "ms_baseline": 1e3 * sec["other"],
                        "gflops_served": flops / sec["served"] / 1e9, "gflops_baseline": flops / sec["other"] / 1e9})
        print(f"{name:8s} linears M={m:<5d} served {1e3 * sec['served']:8.2f} ms "
              f"{flops / sec['served'] / 1e9:6.1f} GFLOP/s   {baseline} {1e3 * sec['other']:8.2f} ms "
              f"{flops / sec['other'] / 1e9:6.1f} GFLOP/s   served/{baseline} {sec['served'] / sec['other']:.2f}")
    return results


def layout_name(args) -> str:
    return "token-major" if args.token_major else "head-major"


def time_compute_bound(args, libs: dict) -> list[dict]:
    """--prefill and --greedy: ms and GFLOP/s (prefill) for each shape, dtype and build variant."""
    results = []
    for shape in args.prefill or []:
        batch, extend = map(int, shape.split("+")[0].split("x"))
        prefix = int(shape.split("+")[1]) if "+" in shape else 0
        for dtype_name in args.dtypes:
            case = prefill_case(batch, extend, prefix, tuple(args.heads), getattr(torch, dtype_name), args.layers,
                                token_major=args.token_major)
            for name, lib in libs.items():
                if lib is None:
                    print(f"{name}: this CPU cannot run that build")
                    continue
                sec = time_prefill(case, lib, args.reps)
                results.append({"op": "prefill_attention", "variant": name, "dtype": dtype_name, "shape": shape,
                                "heads": list(args.heads), "ms_per_layer": 1e3 * sec,
                                "gflops": case["flops"] / sec / 1e9, "kv_layout": layout_name(args)})
                print(f"prefill attention {dtype_name:8s} {shape:12s} {layout_name(args)} {name:9s} "
                      f"{1e3 * sec:7.3f} ms/layer  {case['flops'] / sec / 1e9:6.1f} GFLOP/s")
    for shape in args.greedy or []:
        rows, vocab = map(int, shape.split("x"))
        for name, lib in libs.items():
            if lib is None:
                print(f"{name}: this CPU cannot run that build")
                continue
            sec = time_greedy(rows, vocab, lib, 10 * args.reps)
            results.append({"op": "greedy_sampling", "variant": name, "shape": shape, "ms": 1e3 * sec})
            print(f"greedy argmax + logsumexp [{rows}, {vocab}] {name:9s} {1e3 * sec:7.3f} ms")
    return results


def _parse_define(part: str) -> tuple[str, int]:
    """"PF_LOCALITY=-1" -> ("PF_LOCALITY", -1); ValueError for anything else."""
    name, sep, value = part.partition("=")
    if not sep or not value.strip().removeprefix("-").isdigit():
        raise ValueError(f"{part!r}: expected NAME=INTEGER")
    return name.strip(), int(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs=3, default=(9, 3, 64), metavar=("HQ", "HK", "D"),
                    help="query heads, KV heads, head dim (default SmolLM2's)")
    ap.add_argument("--layers", type=int, default=30, help="layers of KV to cycle through (default SmolLM2's 30)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto"], choices=list(KV_DTYPES),
                    help="decode attention over KV stored in these formats (--kv_cache_dtype's; auto: as --dtypes)")
    ap.add_argument("--shapes", nargs="+", default=[f"{b}x{c}" for b, c in DECODE_SHAPES], help="BATCHxCONTEXT")
    ap.add_argument("--variants", nargs="+", default=["native"], choices=list(BUILD_VARIANTS))
    ap.add_argument("--define", nargs="+", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also time each --variants build with these compile-time choices of decode_attention.c "
                         f"({', '.join(TUNABLES)}; e.g. PF_LOCALITY=-1 for no prefetch), taking turns rep by rep")
    ap.add_argument("--scatter", action="store_true", help="scatter each request's tokens through the cache")
    ap.add_argument("--token-major", action="store_true",
                    help="decode and prefill attention over a token-major KV cache (each row all heads), not the "
                         "head-major one a CPU server allocates")
    ap.add_argument("--cached", action="store_true",
                    help="every request reads the same rows, which stay in cache: the kernel's time when memory never "
                         "holds it up (its GB/s then counts the bytes it would read from memory)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--linears", type=int, nargs="+", metavar="M",
                    help="instead: linears of --dtypes at these row counts, as served against oneDNN's prepacked GEMM, "
                         "and the float32 FMA peak")
    ap.add_argument("--prefill", nargs="+", metavar="BxE[+P]",
                    help="instead: prefill attention, B requests of E new tokens over a shared cached P-token prefix")
    ap.add_argument("--greedy", nargs="+", metavar="BxV", help="instead: greedy sampling over [B, V] float32 logits")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    rerun_under_tcmalloc()

    print(f"# {cpu_caption()}, {time.strftime('%Y-%m-%d %H:%M')}")
    if args.linears:
        every_m = pairs_take_every_m(library())
        fp32 = "linear.c at every M" if library() is not None else "F.linear (no C library)"
        bf16 = "linear.c at every M" if every_m else "linear.c at M <= 4, oneDNN above"
        print(f"served: float32 {fp32}; bf16 {bf16}; SmolLM2's projections over {args.layers} layers and its lm_head")
        results = [r for name in args.dtypes for r in time_linears(args.linears, args.layers, args.reps,
                                                                   getattr(torch, name))]
        peak = fma_peak(torch.get_num_threads())
        if peak:
            shares = ", ".join(f"M={r['rows']} {100 * r['gflops_served'] / peak:.0f}%"
                               for r in results if r["op"] == "linear_float32")
            print(f"float32 FMA peak ({torch.get_num_threads()} threads, scripts/fma_peak.c): {peak:.1f} GFLOP/s"
                  + (f"; served float32 at {shares}" if shares else ""))
        if args.json:
            Path(args.json).write_text(json.dumps({"cpu": cpu_caption(), "fma_peak_gflops": peak,
                                                   "results": results}, indent=1))
        return

    try:
        tunings = [dict(_parse_define(part) for part in spec.split(",")) for spec in args.define]
        libs = {name + "".join(f"+{k}={v}" for k, v in tuning.items()): variant_library(name, tuning)
                for name in args.variants for tuning in [{}, *tunings]}
    except ValueError as exc:
        ap.error(f"--define: {exc}")
    if args.prefill or args.greedy:
        results = time_compute_bound(args, libs)
        if args.json:
            Path(args.json).write_text(json.dumps({"cpu": cpu_caption(), "results": results}, indent=1))
        return
    # This VM's read bandwidth drifts (24-50 GB/s within a minute here): each timing reads it after every rep, and
    # its share is the median over the reps of the rep's GB/s over the reading after it.
    bws = []
    results = []
    for dtype_name, kv_name, shape in itertools.product(args.dtypes, args.kv_dtypes, args.shapes):
        dtype = getattr(torch, dtype_name)
        batch, context = map(int, shape.split("x"))
        case = decode_case(batch, context, tuple(args.heads), dtype, args.layers, args.scatter,
                           cached=args.cached, token_major=args.token_major, kv_dtype=KV_DTYPES[kv_name])
        kv_label = str(case["k"].dtype).removeprefix("torch.")
        # A layer's K and V rows, and int8's float32 scale per row and KV head.
        row_bytes = args.heads[2] * case["k"].element_size() + (4 if case["k"].dtype == torch.int8 else 0)
        kv_bytes = 2 * batch * context * args.heads[1] * row_bytes
        for name in [name for name, lib in libs.items() if lib is None]:
            print(f"{name}: this CPU cannot run that build")
        timed = time_decode(case, {name: lib for name, lib in libs.items() if lib is not None}, args.reps)
        for name, (sec, pairs) in timed.items():
            readings = [bw for _, bw in pairs]
            bws += readings
            gbps, share = kv_bytes / sec / 1e9, statistics.median(kv_bytes / 1e9 / s / bw for s, bw in pairs)
            results.append({"op": "decode_attention", "variant": name, "dtype": dtype_name, "kv_dtype": kv_label,
                            "kv_bytes": kv_bytes, "batch": batch,
                            "context": context, "cached": args.cached, "heads": list(args.heads),
                            "kv_layout": layout_name(args),
                            "ms_per_layer": 1e3 * sec, "gbps": gbps,
                            "rep_ms_per_layer": [1e3 * s for s, _ in pairs], "read_gbps": readings,
                            "share_of_bandwidth": share})
            base = name.split("+")[0]  # a --define build against its variant's own, timed in turn with it
            against = f"; {sec / timed[base][0]:.2f}x {base}'s time" if base != name and base in timed else ""
            print(f"decode attention {dtype_name:8s} KV {kv_label:13s} B={batch:<3d} L={context:<5d} "
                  f"{layout_name(args)} {name:9s} "
                  f"{1e3 * sec:7.3f} ms/layer  {kv_bytes / 1e6:6.1f} MB  {gbps:6.1f} GB/s  {100 * share:5.1f}% "
                  f"of the read bandwidth (median over reps, each against the reading after it; "
                  f"{min(readings):.1f}-{max(readings):.1f} GB/s{against})")
        del case
    if bws:
        print(f"streaming read bandwidth (torch.sum, 256 MB), {len(bws)} readings: median {statistics.median(bws):.1f}"
              f" GB/s (range {min(bws):.1f}-{max(bws):.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_caption(), "read_gbps_readings": bws, "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
