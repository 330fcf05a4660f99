#!/usr/bin/env python3
"""Where the time of one decode step goes, measured in one process with the real objects.

Builds B running requests of a given context length, then times each stage of a step as the
server runs it: router planning (Scheduler.plan_step + finish_step), plan (de)serialization,
the worker's forward, sampling and the shm writes (OutputWriter), and the detokenizer's incremental
decode. Prints each stage's median and its share of the step, then the forward by op group twice:
torch.profiler's table of the last step (every op, but each C call's range adds tens of us), and
the C kernels timed without the profiler over the other steps (kernels.cpu.kernel_times).

    python scripts/profile_step.py --batch 64 --context 384 --dtype float32
    python scripts/profile_step.py --batch 1 --context 256 --prefill   # the prefill step instead
    python scripts/profile_step.py --batch 15 --context 48 --prefix 1024 --prefill  # W3's suffix prefill

It runs under tcmalloc, as the server's CPU workers do (host_tuning.preload_tcmalloc: with glibc malloc every
large temporary is mmapped and faulted in again on each call). A decode profile ends with the step's physical
floor: the bytes it must read (weights and KV) at this machine's streaming read bandwidth, and its FLOPs at this
machine's GEMM rate, both measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from bench_cpu_kernels import cpu_caption, read_bandwidth, rerun_under_tcmalloc  # scripts/, beside this file

from lightserve import kernels
from lightserve.config import AdmissionPolicy
from lightserve.engine.model_prep import ensure_default_model, prepare_gguf
from lightserve.kernels.cpu import kernel_times
from lightserve.kernels.linear import cpu_pack_for
from lightserve.messages import decode, encode
from lightserve.model_config import ModelConfig
from lightserve.model_infer.kv_cache import kv_row_bytes
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import gguf_weights, read_model_config
from lightserve.model_infer.output_writer import OutputWriter
from lightserve.model_infer.process import torch_dtype
from lightserve.router.admission import Admission
from lightserve.router.kv_allocator import KVAllocator
from lightserve.router.radix_cache import RadixCache
from lightserve.router.scheduler import Limits, Scheduler
from lightserve.sampling import SamplingParams
from lightserve.shm.req_pool import ReqPool

# The C linears' labels first: "linear" would also match them. GEMMs that torch runs (oneDNN: AMX and other large
# bf16 shapes, or no C kernels) have their own group, so that the floor's step GEMM rate counts their time too.
TORCH_GEMM = "linear (GEMM, torch)"
GROUPS = {  # op name or C kernel label fragment -> op group
    "linear_cpu": "linear (GEMM)", "linear_bf16_cpu": "linear (GEMM)", "linear_silu_cpu": "linear (GEMM)",
    "argmax_head_cpu": "linear (GEMM)",  # the lm_head screened in bf16 (kernels/argmax_head.py)
    "mm": TORCH_GEMM, "addmm": TORCH_GEMM, "linear": TORCH_GEMM, "mkldnn_linear": TORCH_GEMM,
    "decode_attention_cpu": "attention", "prefill_attention_cpu": "attention",
    "rmsnorm_cpu": "norms",
    "silu_and_mul_cpu": "activation", "rotary_cpu": "rotary", "argmax_logsumexp_cpu": "sampling",
    "scaled_dot_product": "attention", "index_select": "attention (KV gather)", "bmm": "attention",
    "softmax": "attention", "rsqrt": "norms", "pow": "norms", "mean": "norms", "silu": "activation",
    "embedding": "embedding", "index_put": "KV write / tables", "store_kv_cpu": "KV write / tables",
    "index_copy": "KV write / tables", "copy_": "copies", "cat": "copies",
    # The one C call of a Llama-family CPU forward's layers (kernels/decoder_layers.py): the profiler sees it whole;
    # the timed table splits it by kernel.
    "decoder_layers_cpu": "decoder layers (one C call)",
}


def _group(name: str) -> str | None:
    return next((g for k, g in GROUPS.items() if k in name), None)


def gemm_rate(dtype: torch.dtype, rows: int, mc: ModelConfig) -> float:
    """GFLOP/s of the serving path's linear on the model's widest layer (gate_up) at `rows` rows, the best of 30
    calls: the weight laid out as the model lays it out at load (cpu_pack_for), so a bf16 rate is not torch's
    F.linear, which repacks plain bf16 weights on every call. The best, not the median, because it stands for the
    machine's ceiling and the host's noise only slows calls down: a median of 10 once read 223 GFLOP/s here (Zen 4,
    bf16) in a step whose own GEMMs ran at 413, which put the floor above the step."""
    x = torch.randn(rows, mc.hidden_size).to(dtype)
    w = torch.randn(2 * mc.intermediate_size, mc.hidden_size).to(dtype)
    pack = cpu_pack_for(w)
    weight = pack(w) if pack is not None else w
    kernels.linear(x, weight)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        kernels.linear(x, weight)
        times.append(time.perf_counter() - t)
    return 2 * rows * w.numel() / min(times) / 1e9


def physical_floor(mc: ModelConfig, batch: int, context: int, dtype: torch.dtype,
                   step_gemm_s: float | None = None, kv_dtype: torch.dtype | None = None,
                   weight_bytes: int | None = None) -> float:
    """Print what one decode step must cost here at least: its bytes (all weights once, every request's KV)
    at the measured read bandwidth, and its FLOPs at the measured GEMM rate; the floor is the larger. The GEMM rate
    is the better of gemm_rate() and the rate the step's own linears reached (their FLOPs over step_gemm_s, the
    seconds of the C linears and of torch's GEMMs in the step): the host sometimes halves gemm_rate()'s 30 calls in a
    row (Zen 4: 217 GFLOP/s in a run whose step's GEMMs ran at 410), which put the floor above the step. The KV
    bytes are those of `kv_dtype` (--kv_cache_dtype; None = the activation dtype), int8's scales included. The
    weights' bytes are `weight_bytes` where given (a GGUF file's size: its blocks, read once a step), else every
    parameter in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    h, d = mc.hidden_size, mc.head_dim
    layer_params = h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h + 3 * h * mc.intermediate_size
    params = mc.num_layers * layer_params + mc.vocab_size * h  # + lm_head; the embedding reads only B rows
    kv_bytes = batch * context * mc.num_layers * 2 * mc.num_kv_heads * kv_row_bytes(d, kv_dtype or dtype)
    flops = 2 * batch * params + 4 * batch * context * mc.num_layers * mc.num_heads * d
    bw = read_bandwidth()
    bench = gemm_rate(dtype, max(batch, 512), mc)  # the GEMM ceiling: large M
    step_rate = 2 * batch * params / step_gemm_s / 1e9 if step_gemm_s else 0.0
    rate = max(bench, step_rate)
    weight_bytes = weight_bytes or params * size
    mem_ms, flop_ms = 1e3 * (weight_bytes + kv_bytes) / (bw * 1e9), 1e3 * flops / (rate * 1e9)
    print(f"  physical floor ({cpu_caption()}):")
    kv_name = str(kv_dtype or dtype).removeprefix("torch.")
    print(f"    bytes: {weight_bytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.0f} MB {kv_name} KV at {bw:.1f} GB/s "
          f"read -> {mem_ms:.1f} ms")
    own = f", the step's own linears {step_rate:.0f}" if step_rate else ""
    print(f"    FLOPs: {flops / 1e9:.1f} GFLOP at {rate:.0f} GFLOP/s (the better of: {dtype} linear as served at "
          f"M={max(batch, 512)} {bench:.0f}{own}) -> {flop_ms:.1f} ms")
    print(f"    floor: {max(mem_ms, flop_ms):.1f} ms")
    return max(mem_ms, flop_ms)


def _profiled_forward(runner: ModelRunner, plan, op_time: dict, ungrouped: dict,
                      argmax_only: bool = False) -> torch.Tensor:
    """runner.forward(plan) under torch.profiler; adds each op group's self CPU time to op_time."""
    with torch.profiler.profile() as prof:
        logits = runner.forward(plan, argmax_only)
    for evt in prof.key_averages():
        group = _group(evt.key)
        if group is None and evt.key.startswith("aten::"):
            ungrouped[evt.key] += evt.self_cpu_time_total / 1e6
        # aten and oneDNN ops, plus our C kernels' record_function ranges (their time is self time)
        if group and (evt.key.startswith(("aten::", "mkldnn::")) or evt.key.endswith("_cpu")):
            op_time[group] += evt.self_cpu_time_total / 1e6
    return logits


def _print_op_groups(op_time: dict, ungrouped: dict, what: str) -> None:
    print(f"  forward by op group ({what}, torch.profiler self CPU time):")
    for g, v in sorted(op_time.items(), key=lambda kv: -kv[1]):
        print(f"    {g:30s} {1e3 * v:8.2f} ms")
    for name, v in sorted(ungrouped.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {'(other) ' + name:30s} {1e3 * v:8.2f} ms")


def _print_kernel_times(steps: list[dict[str, float]], forward: float, step: float) -> dict[str, float]:
    """The C kernels' wall times without the profiler (kernels.cpu.kernel_times), by op group: medians over the
    steps, as shares of the whole step; the rest of the forward is torch ops (oneDNN GEMMs where they run) and
    Python. Returns the medians (seconds by op group)."""
    groups = [defaultdict(float) for _ in steps]
    for per_group, times in zip(groups, steps):
        for name, sec in times.items():
            per_group[_group(name) or name] += sec
    med = {g: statistics.median(pg.get(g, 0.0) for pg in groups) for g in set().union(*groups)}
    print(f"  C kernels timed without the profiler (median of {len(steps)} steps; the profiler's ranges above "
          "add tens of us to each call):")
    for g, v in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"    {g:30s} {1e3 * v:8.2f} ms  {100 * v / step:5.1f}%")
    rest = forward - sum(med.values())
    print(f"    {'rest of the forward':30s} {1e3 * rest:8.2f} ms  {100 * rest / step:5.1f}%")
    return med


class _NoSocket:
    def send(self, *_args, **_kw) -> None:
        pass

    def close(self, **_kw) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=384, help="tokens already in each request's KV")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed; with --prefill, prefill runs")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv_cache_dtype", default="auto",
                    choices=["auto", "float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"],
                    help="how the KV cache stores K and V, as the server's flag (auto: --dtype)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--report-logprobs", action="store_true",
                    help="requests that show their tokens' logprobs (default: none, as benchmark clients ask; a "
                    "float32 model then screens its lm_head in bf16: any batch where the CPU multiplies bf16 "
                    "natively, up to 4 rows elsewhere)")
    ap.add_argument("--model_dir", default=None,
                    help="a checkpoint folder or a .gguf file (default: SmolLM2, prepared as make does)")
    ap.add_argument("--quant_activations", choices=["none", "int8"], default="none",
                    help="as the server's flag: GGML-block weights multiply int8 activations")
    ap.add_argument("--prefill", action="store_true",
                    help="profile the prefill step (batch x context prompt tokens) and stop")
    ap.add_argument("--prefix", type=int, default=0,
                    help="with --prefill: every prompt starts with the same PREFIX tokens, already in the "
                         "radix cache (one extra request computed them), so the step computes only the suffixes")
    args = ap.parse_args()
    rerun_under_tcmalloc()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or str(ensure_default_model())
    if model_dir.endswith(".gguf"):
        model_dir = str(prepare_gguf(Path(model_dir)))
    mc = read_model_config(model_dir)
    b, ctx = args.batch, args.context
    if args.prefix and not args.prefill:
        ap.error("--prefix needs --prefill")
    max_len = args.prefix + ctx + args.steps + 64
    rows = b + (1 if args.prefix else 0)
    kv_size = rows * max_len + 64
    kv_dtype = torch_dtype(args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
    runner = ModelRunner(model_dir, mc, getattr(torch, args.dtype), torch.device("cpu"), 0, 1, None,
                         num_req_rows=rows, max_req_total_len=max_len, kv_size=kv_size, kv_dtype=kv_dtype,
                         int8_activations=args.quant_activations == "int8")
    pool = ReqPool.create(f"lightserve-{os.getpid()}-{secrets.token_hex(3)}-prof", rows, max_len)
    try:
        rng = np.random.default_rng(0)
        alloc = KVAllocator(kv_size)
        sched = Scheduler(pool, alloc, RadixCache(alloc), Admission(AdmissionPolicy.OPTIMISTIC),
                          Limits(rows, 1 << 20, 1 << 20, max_len))
        prefix = rng.integers(100, mc.vocab_size, args.prefix).tolist()
        writer = OutputWriter(pool, mc, model_dir, _NoSocket(), _NoSocket())

        def add(i: int) -> None:
            prompt = prefix + rng.integers(100, mc.vocab_size, ctx).tolist()
            pool.acquire(i, i + 1)
            params = SamplingParams(max_new_tokens=max_len - len(prompt), ignore_eos=True,
                                    report_logprobs=args.report_logprobs)
            pool.write_request(i, prompt, params, 0)
            sched.add_req(i, i + 1)

        if args.prefix:  # request `b` computes the prefix; its step puts it in the radix cache
            add(b)
            record = sched.plan_step()
            writer.write(record.plan, runner.forward(record.plan), 0.0)
            sched.finish_step(record)
        for i in range(b):
            add(i)
        # The prefill step (measured with --prefill, after one unmeasured run of the same plan),
        # then decode steps.
        record = sched.plan_step()
        if args.prefill:
            runner.forward(record.plan)  # warm-up; rewrites the same KV rows
            op_time, ungrouped = defaultdict(float), defaultdict(float)
            runs, kernels_per_run = [], []  # --steps runs of the same prefill: one run is too noisy to share out
            for _ in range(args.steps):
                with kernel_times() as ktimes:
                    t = time.perf_counter()
                    runner.forward(record.plan)
                    runs.append(time.perf_counter() - t)
                kernels_per_run.append(ktimes)
            took = statistics.median(runs)
            _profiled_forward(runner, record.plan, op_time, ungrouped)
            over = f" over a cached {args.prefix}-token prefix (+1 decode)" if args.prefix else ""
            print(f"prefill step, {b} x {ctx} prompt tokens{over}, {args.dtype}, {args.threads} threads: "
                  f"forward {1e3 * took:.1f} ms ({b * ctx / took:.0f} tokens/s; median of {len(runs)} runs, "
                  f"{1e3 * min(runs):.1f}-{1e3 * max(runs):.1f})")
            _print_op_groups(op_time, ungrouped, "one more run")
            _print_kernel_times(kernels_per_run, took, took)
            return
        writer.write(record.plan, runner.forward(record.plan), 0.0)
        sched.finish_step(record)
        times = defaultdict(list)
        op_time = defaultdict(float)
        ungrouped = defaultdict(float)  # aten ops outside GROUPS, to spot what else costs
        step_kernels = []  # per unprofiled step: the C kernels' seconds by label
        from transformers import AutoTokenizer

        from lightserve.detokenizer.incremental import IncrementalDecoder
        tok = AutoTokenizer.from_pretrained(model_dir)
        decoders = [IncrementalDecoder(tok, [], True) for _ in range(b)]
        for step in range(args.steps):
            t = time.perf_counter()
            record = sched.plan_step()
            times["router: plan_step"].append(time.perf_counter() - t)
            t = time.perf_counter()
            plan = decode(encode(record.plan))
            times["IPC: plan encode+decode"].append(time.perf_counter() - t)
            t = time.perf_counter()
            argmax_only = writer.argmax_only(plan)  # as the worker asks
            if step == args.steps - 1:
                logits = _profiled_forward(runner, plan, op_time, ungrouped, argmax_only)
            else:
                with kernel_times() as ktimes:
                    logits = runner.forward(plan, argmax_only)
                step_kernels.append(ktimes)
            times["worker: forward"].append(time.perf_counter() - t)
            t = time.perf_counter()
            writer.write(plan, logits, 0.0)
            times["worker: sample + shm write"].append(time.perf_counter() - t)
            t = time.perf_counter()
            sched.finish_step(record)
            times["router: finish_step"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(b):
                n = int(pool.num_output[i])
                decoders[i].push(pool.output_ids(i, n - 1, n).tolist())
            times["detokenizer: decode"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        total = sum(med.values())
        print(f"decode step, batch {b}, context {ctx}, {args.dtype}, {str(kv_dtype).removeprefix('torch.')} KV, "
              f"{args.threads} threads")
        for k, v in med.items():
            print(f"  {k:32s} {1e3 * v:8.2f} ms  {100 * v / total:5.1f}%")
        print(f"  {'total':32s} {1e3 * total:8.2f} ms   -> {b / total:.0f} tokens/s")
        overhead = total - med["worker: forward"]
        print(f"  outside the model forward: {1e3 * overhead:.2f} ms ({100 * overhead / total:.1f}% of the step)")
        if op_time:
            _print_op_groups(op_time, ungrouped, "last step")
        kernel_med = _print_kernel_times(step_kernels, med["worker: forward"], total) if step_kernels else {}
        # The step's GEMM seconds: the C linears (median over the steps) and torch's (the profiled step).
        gemm_s = kernel_med.get("linear (GEMM)", 0.0) + op_time.get(TORCH_GEMM, 0.0)
        gguf_file = gguf_weights(model_dir)
        floor_ms = physical_floor(mc, b, ctx, getattr(torch, args.dtype), gemm_s, kv_dtype,
                                  gguf_file.stat().st_size if gguf_file else None)
        print(f"    this step: {1e3 * total:.1f} ms = {1e3 * total / floor_ms:.2f}x the floor")
    finally:
        pool.close()
        pool.segment.unlink()


if __name__ == "__main__":
    main()
