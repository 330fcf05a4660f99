"""Time every op of lightserve.kernels on realistic shapes: the Triton kernels on CUDA, the torch references
(the CPU serving path) on CPU. Prints time, achieved GB/s and TFLOP/s, and their fraction of the given peaks.

    python scripts/bench_kernels.py                      # CUDA if present, else CPU
    python scripts/bench_kernels.py --device cpu --models smollm2 --json results/kernels_cpu.json

The default peaks are an H200's; on CPU pass this machine's (--peak_gbps, --peak_tflops) for meaningful fractions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

from lightserve import kernels
from lightserve.kernels.activation import silu_and_mul_triton
from lightserve.kernels.decode_attention import decode_attention_triton
from lightserve.kernels.kv_store import store_kv_triton
from lightserve.kernels.prefill_attention import prefill_attention_triton
from lightserve.kernels.rmsnorm import add_rmsnorm_triton, rmsnorm_triton
from lightserve.kernels.rotary import rotary_emb_triton


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    inter: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = {
    "smollm2": ModelShape(hidden=576, inter=1536, num_heads=9, num_kv_heads=3, head_dim=64),
    "llama8b": ModelShape(hidden=4096, inter=14336, num_heads=32, num_kv_heads=8, head_dim=128),
}
# Token counts of the elementwise ops: a decode batch and a prefill chunk. CPU shapes stay small enough to finish
# in about a minute; (64, 400) and (1, 512) are the decode shapes measured for decode_attention_ref's layout.
TOKENS = {"cuda": [64, 4096], "cpu": [64, 1024]}
DECODE = {"cuda": [(1, 512), (64, 400), (64, 4096), (256, 2048)], "cpu": [(1, 512), (64, 400)]}
PREFILL = {  # (prefix_len, extend_len) per request
    "cuda": [[(0, 512)] * 4, [(1536, 512)], [(0, 4096)]],
    "cpu": [[(0, 512)] * 4, [(1536, 512)]],
}


@dataclass
class Result:
    model: str
    op: str
    shape: str
    backend: str
    ms: float
    gbps: float
    tflops: float
    frac_peak_gbps: float
    frac_peak_tflops: float


def main() -> None:
    args = _parse_args()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = device.type == "cuda"
    where = torch.cuda.get_device_name(device) if on_gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"{'Triton kernels' if on_gpu else 'torch references'} on {where}, {args.dtype}")
    print(f"{'model':8} {'op':18} {'shape':34} {'ms':>9} {'GB/s':>8} {'%bw':>6} {'TFLOP/s':>8} {'%flop':>6}")
    results = []
    for model in args.models:
        for op, shape, fn, num_bytes, flops in _cases(MODELS[model], device, dtype, on_gpu):
            ms = _time_ms(fn, on_gpu)
            gbps, tflops = num_bytes / ms / 1e6, flops / ms / 1e9
            r = Result(model, op, shape, "triton" if on_gpu else "ref", ms, gbps, tflops,
                       gbps / args.peak_gbps, tflops / args.peak_tflops)
            results.append(r)
            flop_cols = f"{tflops:8.3f} {100 * r.frac_peak_tflops:5.1f}%" if flops else ""
            print(f"{model:8} {op:18} {shape:34} {ms:9.4f} {gbps:8.1f} {100 * r.frac_peak_gbps:5.1f}% {flop_cols}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "dtype": args.dtype, "peak_gbps": args.peak_gbps,
                       "peak_tflops": args.peak_tflops, "results": [asdict(r) for r in results]}, f, indent=1)


def _cases(m: ModelShape, device: torch.device, dtype: torch.dtype, on_gpu: bool):
    """Yield (op, shape, fn, bytes moved, flops) for one model; fn runs the Triton kernel on GPU, the ref on CPU."""
    es = torch.empty((), dtype=dtype).element_size()
    pick = (lambda triton_fn, ref_fn: triton_fn) if on_gpu else (lambda triton_fn, ref_fn: ref_fn)
    hq, hk, d = m.num_heads, m.num_kv_heads, m.head_dim
    for t in TOKENS[device.type]:
        x = torch.randn(t, m.hidden, dtype=dtype, device=device)
        residual = torch.randn(t, m.hidden, dtype=dtype, device=device)
        w = torch.randn(m.hidden, dtype=dtype, device=device)
        norm, add_norm = pick(rmsnorm_triton, kernels.rmsnorm_ref), pick(add_rmsnorm_triton, kernels.add_rmsnorm_ref)
        yield "rmsnorm", f"T={t} H={m.hidden}", partial(norm, x, w, 1e-5), 2 * t * m.hidden * es, 0
        yield "add_rmsnorm", f"T={t} H={m.hidden}", partial(add_norm, x, residual, w, 1e-5), 4 * t * m.hidden * es, 0

        qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype, device=device)
        q = qkv[:, :hq * d].view(t, hq, d)  # [T, Hq, D], strided view as the model passes it
        k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)  # [T, Hk, D]
        v = qkv[:, (hq + hk) * d:].view(t, hk, d)  # [T, Hk, D]
        positions = torch.randint(0, 4096, (t,), device=device)
        cos_sin = torch.randn(4096, d, device=device)
        rope = pick(rotary_emb_triton, kernels.rotary_emb_ref)
        rope_bytes = 2 * t * (hq + hk) * d * es + t * d * 4
        yield "rotary_emb", f"T={t} Hq={hq} Hk={hk} D={d}", partial(rope, q, k, positions, cos_sin), rope_bytes, 0
        # with the Walsh-Hadamard transform an int8 KV cache asks for (its tl.dot products)
        yield ("rotary_emb hadamard", f"T={t} Hq={hq} Hk={hk} D={d}",
               partial(rope, q, k, positions, cos_sin, hadamard=True), rope_bytes, 0)

        k_cache = torch.zeros(4 * t, hk, d, dtype=dtype, device=device)
        v_cache = torch.zeros(4 * t, hk, d, dtype=dtype, device=device)
        kv_locs = torch.randperm(4 * t, device=device)[:t]
        store = pick(store_kv_triton, kernels.store_kv_ref)
        yield ("store_kv", f"T={t} Hk={hk} D={d}", partial(store, k, v, k_cache, v_cache, kv_locs),
               4 * t * hk * d * es, 0)

        gate_up = torch.randn(t, 2 * m.inter, dtype=dtype, device=device)
        act = pick(silu_and_mul_triton, kernels.silu_and_mul_ref)
        yield "silu_and_mul", f"T={t} I={m.inter}", partial(act, gate_up), 3 * t * m.inter * es, 0

    scale = d ** -0.5
    for batch, seq_len in DECODE[device.type]:
        cache = _kv_layout([seq_len] * batch, hk, d, dtype, device)
        q = torch.randn(batch, hq, d, dtype=dtype, device=device)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        fn = pick(decode_attention_triton, kernels.decode_attention_ref)
        num_keys = batch * seq_len
        yield ("decode_attention", f"B={batch} L={seq_len} Hq={hq} Hk={hk} D={d}",
               partial(fn, q, *cache, seq_lens, seq_len, scale),
               2 * num_keys * hk * d * es + 4 * num_keys + 2 * batch * hq * d * es, 4 * num_keys * hq * d)

    for reqs in PREFILL[device.type]:
        cache = _kv_layout([p + e for p, e in reqs], hk, d, dtype, device)
        extend = [e for _, e in reqs]
        q = torch.randn(sum(extend), hq, d, dtype=dtype, device=device)
        meta = [torch.tensor(vals, dtype=torch.int32, device=device)
                for vals in ([0, *extend[:-1]], [p for p, _ in reqs], extend)]
        meta[0] = meta[0].cumsum(0, dtype=torch.int32)  # q_start_locs
        fn = pick(prefill_attention_triton, kernels.prefill_attention_ref)
        # Causal: new token i of a request with prefix p attends to p + i + 1 keys.
        num_pairs = sum(e * p + e * (e + 1) // 2 for p, e in reqs)
        num_keys = sum(p + e for p, e in reqs)
        yield ("prefill_attention", f"{len(reqs)}x(prefix {reqs[0][0]}, new {reqs[0][1]})",
               partial(fn, q, *cache, *meta, max(extend), scale),
               2 * num_keys * hk * d * es + 2 * q.numel() * es, 4 * num_pairs * hq * d)


def _kv_layout(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """(k_cache, v_cache, req_to_token, req_rows) with every request's tokens scattered through the cache."""
    num_rows = sum(seq_lens)
    k_cache = torch.randn(num_rows, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_rows, num_kv_heads, head_dim, dtype=dtype, device=device)
    rows = torch.randperm(num_rows, device=device).to(torch.int32)
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32, device=device)
    offset = 0
    for i, n in enumerate(seq_lens):
        req_to_token[i, :n] = rows[offset:offset + n]
        offset += n
    req_rows = torch.arange(len(seq_lens), dtype=torch.int32, device=device)
    return k_cache, v_cache, req_to_token, req_rows


def _time_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    if on_gpu:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # warm-up: first calls allocate and pick kernels
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < 0.5 and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3  # CPU timings vary 15-40% run to run: the median resists outliers


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--peak_gbps", type=float, default=4800.0, help="memory bandwidth peak; H200 HBM3e by default")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="dense bf16 tensor-core peak; H200 by default")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args()


if __name__ == "__main__":
    main()
