#!/usr/bin/env python3
"""The Python stages of scripts/gpu_check.sh, one subcommand each; every stage writes a JSON file and a
summary line, and exits non-zero when a check fails.

  checkpoints  random-weight checkpoints built with transformers: SmolLM2-135M's exact config with its
               tokenizer, and Llama-3.1-8B's config cut to 4 layers (full width, vocab, llama3 rope)
  runner       (b) the model runner in this process against transformers: a chunked long prefill and
               greedy decode steps (teacher-forced), and CUDA-graph replay against eager, bit for bit
  server       (c) a real server (every process, shm, zmq): greedy tokens against transformers on 16
               prompts, then scripts/benchmark_serving.py's W1 load
  timings      (d) the 8B shape: decode steps, decode attention bandwidth, an 8k prefill, graph
               capture, the KV size chosen, time outside the forward and the Triton kernels that serving
               would compile after warm-up

Every stage runs the GPU code path (`--kernel_backend triton`); `--device cpu` runs it on small shapes under
Triton's interpreter (the dry run tests/scripts/test_gpu_check.py makes part of the test suite), so the GPU
check cannot rot between GPU runs. The file is longer than 400 lines on purpose: it is the one script a GPU run
carries, and its stages share the helpers at the bottom.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
# Peak HBM bandwidth (bytes/s, vendor figures) by a substring of torch.cuda.get_device_name, most specific first.
# A name no entry matches gets no bandwidth share: the report says so rather than assume one.
HBM_PEAK_BYTES_S: tuple[tuple[str, float | None], ...] = (
    ("GH200", None),                 # 96 GB HBM3 (4.0e12) and 144 GB HBM3e (4.9e12) share the name
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100 80GB HBM3", 3.35e12),     # the SXM5 part's name
    ("H100 SXM", 3.35e12),
    ("H200", 4.8e12),                # SXM and NVL
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("L40S", 0.864e12),
)
# Greedy tokens are compared with transformers' logits (teacher-forced, same dtype). A token other than
# transformers' top one passes as a tie when its logit is within TIE_STEPS[dtype] steps of the top logit, a
# step being the spacing of that dtype's numbers at the top logit's magnitude (taken as at least 1.0):
# finfo(dtype).eps * 2**floor(log2|top|).
# - bfloat16 keeps 8 significant bits, so a step is 2**-7 of the magnitude's power of two: 0.0156 for the
#   random-weight checkpoints' top logits (~2.1), 0.125 for a logit of ~20. Two bf16 forwards that differ in one
#   kernel already disagree by steps: transformers' own eager and sdpa attention in bf16 (CPU, torch 2.13, 300
#   positions of the random-weight SmolLM2) gave top-5 logits 0.5 steps apart on average, 2 at p99, 3 at most, and
#   5 greedy tokens that differed by up to 2.0 steps. Ours differs from transformers in every kernel (and chunks
#   the prefill, splits decode attention), so 4 steps: 0.0625 at 2, 0.5 at 20. A bug moves logits by tens of
#   steps (the random weights' logits spread ~0.5, 32 steps); the reports give max_tie_gap_steps, the margin.
# - float32 (the CPU dry run): other summation orders differ by ~1e-6 relative after a few layers; 1024 steps
#   (1.2e-4 of the magnitude) is still 256x tighter than bf16's 4 steps.
TIE_STEPS = {torch.bfloat16: 4.0, torch.float16: 4.0, torch.float32: 1024.0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 2, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
}
LLAMA31_8B_4L = {  # Llama-3.1-8B's config.json with 4 of its 32 layers
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
}
# The CPU dry run: the same code on shapes a 2-core machine runs in seconds. SmolLM2's vocabulary stays,
# since its tokenizer travels with it.
SMALL = {"smollm2": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024},
         "llama8b": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096}}


@dataclass(frozen=True)
class Shapes:
    """Every size a stage uses; `for_device` picks the GPU run's or the CPU dry run's."""
    prefill_len: int
    prefill_chunk: int
    decode_steps: int
    extra_prompts: tuple[int, ...]       # prompt lengths of the other requests decoding beside the long one
    num_prompts: int
    new_tokens: int
    server_max_len: int
    w1_args: tuple[str, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    timed_steps: int
    timing_prefill: int
    prefill_reps: int
    attention_reps: int

    @staticmethod
    def for_device(device: str) -> Shapes:
        if device == "cuda":
            # 8120 prompt tokens + 64 decode steps = 8184 positions: inside SmolLM2's 8192 (its rope table).
            return Shapes(8192 - 64 - 8, 2048, 64, (100, 1000), 16, 32, 2048,
                          ("--num-prompts", "128", "--input-len-min", "128", "--input-len-max", "512",
                           "--output-len", "128", "--max-concurrency", "64"),
                          (1, 64, 256), (1024, 8192), 20, 8192, 3, 10)
        # The interpreter runs every Triton program in numpy: few tokens, few steps.
        return Shapes(96, 32, 4, (10, 20), 6, 4, 512,
                      ("--num-prompts", "4", "--input-len-min", "16", "--input-len-max", "32",
                       "--output-len", "4", "--max-concurrency", "4"),
                      (1, 4), (32, 64), 1, 64, 1, 1)


# ---------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------

def cmd_checkpoints(args: argparse.Namespace) -> int:
    import transformers

    small = args.device == "cpu"
    for name, config in (("smollm2", SMOLLM2), ("llama8b", LLAMA31_8B_4L)):
        out = Path(args.out) / name
        if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
            continue
        cfg = dict(config, **SMALL[name]) if small else dict(config)
        hf_config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                                          "model_type")})
        hf_config.architectures = cfg["architectures"]
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=_dtype(args.device))
        model.save_pretrained(out)
        if name == "smollm2":
            for f in TOKENIZER_FILES:
                if (Path(args.tokenizer) / f).is_file():
                    (out / f).write_bytes((Path(args.tokenizer) / f).read_bytes())
        del model
        print(f"(checkpoints) {name}: {sum(p.stat().st_size for p in out.iterdir()) / 2**30:.2f} GiB in "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------------------
# (b) the model runner against transformers
# ---------------------------------------------------------------------------------------------------------

def cmd_runner(args: argparse.Namespace) -> int:
    from lightserve.config import KernelBackend
    from lightserve.model_infer.forward_batch import make_forward_batch
    from lightserve.model_infer.model_runner import ModelRunner
    from lightserve.model_infer.models import read_model_config

    shapes = Shapes.for_device(args.device)
    device, dtype = torch.device(args.device), _dtype(args.device)
    cfg = read_model_config(args.model)
    lens = (shapes.prefill_len, *shapes.extra_prompts)
    # Every position the long request reaches must lie inside the model's context (its rope table's length).
    assert shapes.prefill_len + shapes.decode_steps <= cfg.max_position_embeddings, (
        "prompt + decode steps pass max_position_embeddings", shapes.prefill_len, shapes.decode_steps,
        cfg.max_position_embeddings)
    max_len = min(shapes.prefill_len + shapes.decode_steps + 8, cfg.max_position_embeddings)
    record = _launch_recorder()
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    with _recording(record) as warm:
        # One spare request row, so the graphs are captured at 1, 2 and 4 and the 3 decoding requests replay padded.
        runner = ModelRunner(args.model, cfg, dtype, device, 0, 1, None, num_req_rows=len(lens) + 1,
                             max_req_total_len=max_len, kv_size=(len(lens) + 1) * max_len,
                             cuda_graph_max_batch=4 if device.type == "cuda" else 0,
                             kernel_backend=KernelBackend.TRITON)
        _warm_up_off_cuda(runner)
    phases["runner_start_s"] = time.perf_counter() - t0
    backend = runner.model.backend.value                   # as the model resolved it: triton, or the check is void
    if runner.graph_runner is not None:
        phases["graph_capture_s"] = runner.graph_runner.capture_s
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    ours: list[list[torch.Tensor]] = [[] for _ in lens]   # our logits after each prompt, then each decode step
    graph_mismatches, graph_steps = 0, 0
    with _recording(record) as served:
        t0 = time.perf_counter()
        # Chunked prefill, one request at a time; the last chunk samples.
        for r, seq in enumerate(seqs):
            for start in range(0, len(seq), shapes.prefill_chunk):
                chunk = seq[start:start + shapes.prefill_chunk]
                last = start + len(chunk) == len(seq)
                logits = runner.forward(_plan([r], [start], [chunk], max_len, sample=[last]))
                if last:
                    ours[r].append(logits[0].float().cpu())
        phases["prefill_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(shapes.decode_steps):
            for r in range(len(seqs)):
                seqs[r].append(int(ours[r][-1].argmax()))
            rows = list(range(len(seqs)))
            plan = _plan(rows, [len(s) - 1 for s in seqs], [[s[-1]] for s in seqs], max_len,
                         sample=[True] * len(seqs))
            batch = make_forward_batch(plan, runner.kv_cache.req_to_token, runner.staging)
            graphs = runner.graph_runner
            if graphs is not None and graphs.can_run(batch):
                # The replay against an eager forward of the same padded inputs: same kernels, same shapes.
                replayed = graphs.run(batch).clone()
                eager = runner.model.forward(graphs.inputs.batch(_size(graphs, batch)),
                                             runner.kv_cache)[:batch.num_reqs]
                graph_steps += 1
                graph_mismatches += int(not torch.equal(replayed, eager))
                logits = replayed
            else:
                logits = runner.model.forward(batch, runner.kv_cache)
            for r in range(len(seqs)):
                ours[r].append(logits[r].float().cpu())
        phases["decode_s"] = time.perf_counter() - t0
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    hf = _load_hf(args.model, device)
    phases["transformers_load_s"] = time.perf_counter() - t0
    report: dict = {"device": _device_name(device), "kernel_backend": backend,
                    "dtype": str(dtype), "prefill_len": shapes.prefill_len, "chunk": shapes.prefill_chunk,
                    "decode_steps": shapes.decode_steps, "max_position_embeddings": cfg.max_position_embeddings,
                    "tie_steps_allowed": TIE_STEPS[dtype], "requests": []}
    ok = graph_mismatches == 0 and backend == KernelBackend.TRITON.value
    t0 = time.perf_counter()
    for r, seq in enumerate(seqs):
        prompt_len = lens[r]
        with torch.no_grad():
            # Teacher-forced on our tokens: logits at positions prompt_len - 1 .. len(seq) - 1.
            ref = hf(input_ids=torch.tensor([seq], device=device)).logits[0, prompt_len - 1:].float().cpu()
        mine = torch.stack(ours[r])                                        # [steps + 1, V]
        check = compare_greedy(mine.argmax(-1), ref, dtype)
        check["max_abs_logit_diff"] = float((mine - ref).abs().max())
        report["requests"].append({"prompt_len": prompt_len, **check})
        ok &= check["ok"]
    phases["reference_s"] = time.perf_counter() - t0
    report.update(graph_steps=graph_steps, graph_mismatches=graph_mismatches, phases=phases,
                  launch_keys=_launch_report(record, warm, served),
                  max_tie_gap_steps=max(q["max_tie_gap_steps"] for q in report["requests"]), ok=ok)
    _write(args.out, "stage_b.json", report)
    worst = max(q["max_abs_logit_diff"] for q in report["requests"])
    print(f"(b) runner vs transformers: {'PASS' if ok else 'FAIL'}; greedy mismatches outside ties "
          f"{sum(q['bad_steps'] for q in report['requests'])}, ties {sum(q['tie_steps'] for q in report['requests'])} "
          f"(largest gap {report['max_tie_gap_steps']:.2f} of {TIE_STEPS[dtype]:g} {dtype} steps), "
          f"max |logit diff| {worst:.3g}; graph replay vs eager: {graph_mismatches}/{graph_steps} steps differ")
    print("(b) phases: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in phases.items()))
    for line in _launch_lines(report["launch_keys"]):
        print(f"(b) {line}")
    return 0 if ok else 1


def _size(graphs, batch) -> int:
    import bisect

    return graphs.sizes[bisect.bisect_left(graphs.sizes, batch.num_reqs)]


# ---------------------------------------------------------------------------------------------------------
# (c) a real server
# ---------------------------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "Once upon a time,",
    "The three primary colors are", "Explain photosynthesis in one sentence:", "1, 2, 3, 4,", "SELECT * FROM",
    "The quick brown fox", "Translate to German: good morning", "import numpy as np\n", "Dear hiring manager,",
    "The mitochondria is", "In 1969, astronauts", "Q: What is 7 times 8?\nA:", "Roses are red, violets are",
]


def cmd_server(args: argparse.Namespace) -> int:
    """Writes stage_c.json on every path: a server that never gets healthy, a client past its limit, the stage's
    own time limit (SIGTERM) all end with ok false, the reason and the server log's tail."""
    dtype = _dtype(args.device)
    report: dict = {"device": _device_name(torch.device(args.device)), "kernel_backend": None,
                    "dtype": str(dtype), "tie_steps_allowed": TIE_STEPS[dtype], "phase": "start", "prompts": [],
                    "error": None}
    log_path = Path(args.out) / "server_c.log"
    ok = False
    try:
        ok = _serve_and_compare(args, report, log_path)
    except Exception as exc:   # every failure goes into the stage's JSON; the stage then fails
        report["error"] = f"{report['phase']}: {type(exc).__name__}: {exc}"
    except SystemExit:         # SIGTERM (see main)
        report["error"] = f"{report['phase']}: stopped by SIGTERM (the stage's time limit, or its caller)"
        raise
    finally:
        report["ok"] = bool(ok) and report["error"] is None
        if not report["ok"]:
            report["server_log_tail"] = _tail(log_path)
        _write(args.out, "stage_c.json", report)
        print(f"(c) server greedy vs transformers: {'PASS' if report['ok'] else 'FAIL'}; "
              f"{sum(p['bad_steps'] for p in report['prompts'])} mismatches outside ties over "
              f"{len(report['prompts'])} prompts (largest tie gap {report.get('max_tie_gap_steps', 0):.2f} steps); "
              f"W1 rc {report.get('w1_rc')}, {report.get('w1_completed')} done, {report.get('w1_failed')} failed, "
              f"output {report.get('w1_output_tok_s') or 0:.0f} tok/s; shm left: {report.get('shm_left') or 'none'}"
              + (f"; error: {report['error']}" if report["error"] else ""))
    return 0 if report["ok"] else 1


def _serve_and_compare(args: argparse.Namespace, report: dict, log_path: Path) -> bool:
    import httpx

    shapes = Shapes.for_device(args.device)
    device, dtype = torch.device(args.device), _dtype(args.device)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lightserve.launch_server", "--model_dir", args.model, "--device", args.device,
           "--kernel_backend", "triton", "--port", str(port), "--data_type", "bfloat16" if args.device == "cuda"
           else "float32", "--max_req_total_len", str(shapes.server_max_len)]
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        # Its own session: the launcher and its children form one process group that gpu_check.sh kills (from
        # the pgid file) after the stage, whatever way this process ended.
        server = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        if args.pgid_file:
            with open(args.pgid_file, "a") as f:
                f.write(f"{server.pid}\n")
        try:
            _wait_healthy(server, url, args.start_timeout)
            report["start_s"] = time.perf_counter() - t0
            report["phase"] = "prompts"
            with httpx.Client(timeout=args.bench_timeout) as client:
                for text in PROMPTS[:shapes.num_prompts]:
                    body = {"inputs": text, "parameters": {"do_sample": False, "max_new_tokens": shapes.new_tokens,
                                                           "ignore_eos": True, "return_details": True}}
                    resp = client.post(url + "/generate", json=body)
                    resp.raise_for_status()
                    outs.append([t["id"] for t in resp.json()["tokens"]])
            report["phase"] = "w1"
            bench = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_serving.py"), "--backend",
                                    "openai", "--base-url", url, "--tokenizer", args.model, "--dataset", "random",
                                    "--request-rate", "inf", *shapes.w1_args, "--no-progress",
                                    "--output-json", str(Path(args.out) / "w1.json")],
                                   capture_output=True, text=True, timeout=args.bench_timeout)
            (Path(args.out) / "w1.txt").write_text(bench.stdout + bench.stderr)
            report["w1_rc"] = bench.returncode
        finally:
            _stop(server)
    report["server_exit"] = server.returncode
    # The kernels the worker's model resolved, from its start-up line ("KV cache: ..., triton kernels").
    found = re.search(r"KV cache: .*, (\w+) kernels", log_path.read_text(errors="replace"))
    report["kernel_backend"] = found.group(1) if found else "not found in server_c.log"
    report["shm_left"] = [p.name for p in Path("/dev/shm").glob("lightserve-*") if str(server.pid) in p.name]
    w1_path = Path(args.out) / "w1.json"
    w1 = json.loads(w1_path.read_text())["aggregates"] if w1_path.is_file() else {}
    report.update(w1_output_tok_s=w1.get("output_throughput"), w1_completed=w1.get("completed"),
                  w1_failed=w1.get("failed"), served_s=time.perf_counter() - t0)
    report["phase"] = "reference"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    hf = _load_hf(args.model, device)
    ok = (report["w1_rc"] == 0 and not report["shm_left"] and server.returncode is not None
          and w1.get("failed") == 0 and w1.get("completed", 0) > 0 and report["kernel_backend"] == "triton")
    for text, ids in zip(PROMPTS, outs):
        prompt = tok(text).input_ids
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt + ids[:-1]], device=device)).logits[0, len(prompt) - 1:]
        check = compare_greedy(torch.tensor(ids), ref.float().cpu(), dtype)
        report["prompts"].append({"prompt_len": len(prompt), **check})
        ok &= check["ok"]
    report["max_tie_gap_steps"] = max((p["max_tie_gap_steps"] for p in report["prompts"]), default=0.0)
    report["phase"] = "done"
    return ok


# ---------------------------------------------------------------------------------------------------------
# (d) timings on the 8B shape
# ---------------------------------------------------------------------------------------------------------

def cmd_timings(args: argparse.Namespace) -> int:
    from lightserve.config import KernelBackend
    from lightserve.kernels.decode_attention import decode_attention_triton
    from lightserve.model_infer.model_runner import ModelRunner
    from lightserve.model_infer.models import read_model_config

    shapes = Shapes.for_device(args.device)
    device, dtype = torch.device(args.device), _dtype(args.device)
    cuda = device.type == "cuda"
    cfg = read_model_config(args.model)
    max_batch, max_ctx = max(shapes.batches), max(max(shapes.contexts), shapes.timing_prefill)
    row_len = max_ctx + 8
    name = _device_name(device)
    peak, peak_source = hbm_peak_bytes_s(name) if cuda else (None, "not a GPU: no bandwidth share")
    record = _launch_recorder()
    t0 = time.perf_counter()
    with _recording(record) as warm:
        runner = ModelRunner(args.model, cfg, dtype, device, 0, 1, None, num_req_rows=max_batch,
                             max_req_total_len=row_len, kv_size=None if cuda else max_batch * row_len,
                             cuda_graph_max_batch=max_batch if cuda else 0, kernel_backend=KernelBackend.TRITON,
                             # the largest step timed: its activations are set aside before the KV takes the rest
                             max_step_tokens=max(shapes.timing_prefill, max_batch))
        _warm_up_off_cuda(runner)
    report: dict = {"device": name, "kernel_backend": runner.model.backend.value, "dtype": str(dtype),
                    "hbm_peak_bytes_s": peak, "hbm_peak_source": peak_source,
                    "start_s": time.perf_counter() - t0, "kv_size": runner.kv_size,
                    "kv_gib": runner.kv_size * runner.model.kv_bytes_per_token() / 2**30}
    assert runner.kv_size >= max_batch * row_len, ("KV cache too small for the timed shapes", runner.kv_size)
    if runner.graph_runner is not None:
        report.update(graph_capture_s=runner.graph_runner.capture_s,
                      graph_capture_mib=runner.graph_runner.capture_bytes / 2**20)
    compiles = CompileCounter() if cuda else nullcontext()
    with compiles, _recording(record) as served:
        # Row b's tokens sit at KV rows b * row_len + position: contiguous, like a fresh cache.
        table = runner.kv_cache.req_to_token                                  # [max_batch, row_len]
        table.copy_(torch.arange(max_batch * row_len, dtype=torch.int32, device=device).view(max_batch, row_len))
        report["decode"] = [_time_decode(runner, batch, ctx, row_len, shapes)
                            for batch in shapes.batches for ctx in shapes.contexts]
        report["prefill"] = _time_prefill(runner, shapes.timing_prefill, row_len, shapes.prefill_reps)
    # Layer 0's decode attention alone, outside the recording: its direct launches (split counts chosen for `ctx`,
    # not for the row length the model passes) are no step's.
    for d in report["decode"]:
        d.update(_time_attention(runner, d["batch"], d["context"], decode_attention_triton, shapes.attention_reps,
                                 peak))
    # The Triton kernels a server would compile while serving: specializations launched by these steps that
    # the runner's warm-up did not launch (launch keys, also counted under the interpreter), and on a GPU the
    # compiles triton's post-compile hook saw.
    report["launch_keys"] = _launch_report(record, warm, served)
    report["triton_compiles_after_warm_up"] = (compiles.names if compiles.available else "not counted (triton < 3.4)"
                                               ) if cuda else "not counted: the interpreter compiles nothing"
    hook_compiles = compiles.names if cuda and compiles.available else []
    # On a GPU a key not warmed up is a compile (1-3 s) inside a served step: the stage fails. In the dry run the
    # shapes are not the GPU's, so the keys are reported, and only a missing recorder fails.
    new_keys = report["launch_keys"].get("after_warm_up")
    ok = (new_keys is not None and not (cuda and (new_keys or hook_compiles))
          and report["kernel_backend"] == KernelBackend.TRITON.value)
    report["ok"] = ok
    _write(args.out, "stage_d.json", report)
    for d in report["decode"]:
        share = d.get("attn_hbm_share")
        print(f"(d) decode batch {d['batch']:>3} ctx {d['context']:>5}: {d['step_ms']:7.2f} ms/step, "
              f"{d['tok_s']:9.0f} tok/s, outside forward {d['outside_share']:.1%}, attention {d['attn_gb_s']:.3g} GB/s"
              + (f" = {share:.0%} of {peak / 1e12:.2f} TB/s" if share is not None else " (no bandwidth share)"))
    p = report["prefill"]
    print(f"(d) prefill {p['tokens']} tokens: {p['ms']:.1f} ms, {p['tok_s']:.0f} tok/s; KV {report['kv_size']} tokens "
          f"({report['kv_gib']:.1f} GiB); graphs {report.get('graph_capture_s', 0):.1f} s, "
          f"{report.get('graph_capture_mib', 0):.0f} MiB; Triton compiles after warm-up (post-compile hook): "
          f"{len(hook_compiles) if cuda else 'n/a on CPU'}")
    print(f"(d) device {name}: HBM peak {peak_source}")
    for line in _launch_lines(report["launch_keys"]):
        print(f"(d) {line}")
    return 0 if ok else 1


def _time_decode(runner, batch: int, ctx: int, row_len: int, shapes: Shapes) -> dict:
    rows = list(range(batch))
    ids = np.random.default_rng(batch).integers(3, runner.model_config.vocab_size, batch)
    plan = _plan(rows, [ctx - 1] * batch, [[int(i)] for i in ids], row_len, sample=[True] * batch)
    step_s = []
    for i in range(shapes.timed_steps + 2):                  # 2 untimed
        t0 = time.perf_counter()
        logits = runner.forward(plan)
        logits.argmax(-1).cpu()                              # the worker's one read-back
        if i >= 2:
            step_s.append(time.perf_counter() - t0)
    step = float(np.median(step_s))
    forward = _forward_only_s(runner, plan, shapes.timed_steps)
    return {"batch": batch, "context": ctx, "step_ms": step * 1e3, "forward_ms": forward * 1e3,
            "tok_s": batch / step, "outside_share": max(0.0, 1 - forward / step)}


def _forward_only_s(runner, plan, steps: int) -> float:
    """The forward alone: graph replays (or eager forwards) of the step's batch, back to back."""
    from lightserve.model_infer.forward_batch import make_forward_batch

    batch = make_forward_batch(plan, runner.kv_cache.req_to_token, runner.staging)
    graphs = runner.graph_runner
    if graphs is not None and graphs.can_run(batch):
        graphs.inputs.load(batch, _size(graphs, batch))
        fn = graphs.graphs[_size(graphs, batch)].replay
    else:
        def fn():
            runner.model.forward(batch, runner.kv_cache)
    return _device_time(fn, steps, runner.device)


def _time_attention(runner, batch: int, ctx: int, attention, reps: int, peak: float | None) -> dict:
    """Layer 0's decode attention alone (on CPU under the interpreter too, so the call cannot rot): bytes of K and V
    read per second, and that as a share of the GPU's peak HBM bandwidth where the GPU's name gives one."""
    kv = runner.kv_cache
    shards = runner.model.weights.shards
    q = torch.randn(batch, shards.num_heads, runner.model_config.head_dim, dtype=runner.dtype, device=runner.device)
    rows = torch.arange(batch, dtype=torch.int32, device=runner.device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=runner.device)
    scale = runner.model_config.head_dim ** -0.5
    seconds = _device_time(lambda: attention(q, kv.k_caches[0], kv.v_caches[0], kv.req_to_token, rows, lens, ctx,
                                             scale), reps, runner.device)
    bytes_read = 2 * batch * ctx * kv.k_caches[0][0].numel() * kv.k_caches[0].element_size()   # K and V
    return {"attn_us": seconds * 1e6, "attn_gb_s": bytes_read / seconds / 1e9,
            "attn_hbm_share": bytes_read / seconds / peak if peak else None}


def _time_prefill(runner, tokens: int, row_len: int, reps: int) -> dict:
    ids = np.random.default_rng(1).integers(3, runner.model_config.vocab_size, tokens).tolist()
    plan = _plan([0], [0], [ids], row_len, sample=[True])
    runner.forward(plan)
    seconds = _device_time(lambda: runner.forward(plan), reps, runner.device)
    return {"tokens": tokens, "ms": seconds * 1e3, "tok_s": tokens / seconds}


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------

def compare_greedy(ids: torch.Tensor, ref_logits: torch.Tensor, dtype: torch.dtype) -> dict:
    """ids [N]: our greedy tokens; ref_logits [N, V]: transformers' logits at the same positions (teacher-forced
    on our tokens) in `dtype`. A token other than transformers' top one passes as a tie when its logit is within
    TIE_STEPS[dtype] steps of the top one (see TIE_STEPS); the gaps are reported in steps."""
    ref_logits = ref_logits.float()
    top = ref_logits.max(-1).values                                         # [N]
    ours = ref_logits.gather(1, ids.long()[:, None])[:, 0]                 # [N]
    gap_steps = (top - ours) / logit_step(dtype, top)                      # [N], 0 where ours is a top token
    differs = ids != ref_logits.argmax(-1)
    tie = differs & (gap_steps <= TIE_STEPS[dtype])
    bad = differs & ~tie
    return {"steps": int(ids.numel()), "tie_steps": int(tie.sum()), "bad_steps": int(bad.sum()),
            "first_bad": int(bad.nonzero()[0]) if bool(bad.any()) else None,
            "max_tie_gap": float((top - ours)[tie].max()) if bool(tie.any()) else 0.0,
            "max_tie_gap_steps": float(gap_steps[tie].max()) if bool(tie.any()) else 0.0,
            "max_bad_gap_steps": float(gap_steps[bad].max()) if bool(bad.any()) else None,
            "ok": not bool(bad.any())}


def logit_step(dtype: torch.dtype, logits: torch.Tensor) -> torch.Tensor:
    """The spacing of `dtype`'s numbers at |logits| (magnitudes below 1 count as 1): bf16's is 0.125 at 20."""
    magnitude = logits.float().abs().clamp(min=1.0)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))


def hbm_peak_bytes_s(device_name: str) -> tuple[float | None, str]:
    """The peak HBM bandwidth of the GPU named `device_name` (HBM_PEAK_BYTES_S), and where it came from."""
    for part, peak in HBM_PEAK_BYTES_S:
        if part.lower() in device_name.lower():
            if peak is None:
                return None, f"unknown: {part!r} names parts of different bandwidths; no bandwidth share"
            return peak, f"{peak / 1e12:.3g} TB/s (table entry {part!r})"
    return None, f"unknown: no table entry matches {device_name!r}; no bandwidth share"


class CompileCounter:
    """Names the Triton kernels compiled while active (triton's post-compile hook; none under the interpreter)."""

    def __init__(self):
        self.names: list[str] = []
        self.available = False
        self._saved = None

    def __enter__(self) -> CompileCounter:
        import triton

        knobs = getattr(triton, "knobs", None)   # triton >= 3.4
        if knobs is not None:
            self._saved = knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = self._hook
            self.available = True
        return self

    def __exit__(self, *exc) -> None:
        import triton

        if getattr(triton, "knobs", None) is not None:
            triton.knobs.runtime.jit_post_compile_hook = self._saved

    def _hook(self, *args, **kwargs) -> bool:
        self.names.append(str(kwargs.get("repr", "?")).split("[")[0])
        return False


def _launch_recorder():
    """lightserve.kernels.launch_keys.record_launches, or None where this tree lacks the module."""
    try:
        from lightserve.kernels.launch_keys import record_launches
    except ModuleNotFoundError as exc:
        if exc.name != "lightserve.kernels.launch_keys":
            raise
        return None
    return record_launches


def _recording(record):
    """record() (yields a LaunchLog whose .keys are the (kernel, specialization) pairs launched), or a context
    yielding None where there is no recorder."""
    return record() if record is not None else nullcontext()


def _launch_report(record, warm, served) -> dict:
    """The specializations `served` launched that `warm` did not: each as its kernel, its key, and what differs
    from the nearest key the warm-up launched of the same kernel (None: the warm-up never launched that kernel)."""
    if record is None:
        return {"after_warm_up": None, "error": "not recorded: lightserve.kernels.launch_keys is missing"}
    new = []
    for name, spec in sorted(served.keys - warm.keys, key=str):
        seen = [s for n, s in warm.keys if n == name]
        nearest = min(seen, key=lambda s: _spec_diff(s, spec)[0]) if seen else None
        new.append({"kernel": name, "key": str(spec),
                    "differs_from_warm_up": _spec_diff(nearest, spec)[1] if nearest is not None else None})
    return {"warm_up": len(warm.keys), "served": len(served.keys), "after_warm_up": new}


def _spec_diff(warm: tuple, served: tuple) -> tuple[int, list[str]]:
    """How many entries of two specialization keys of one kernel differ, and those entries (warm -> served)."""
    diffs = [f"{a[0]}: {a[1:]} -> {b[1:]}" for a, b in zip(warm, served) if a != b]
    return len(diffs) + abs(len(warm) - len(served)), diffs


def _launch_lines(launches: dict) -> list[str]:
    if launches.get("error"):
        return [f"Triton launch keys {launches['error']}"]
    new = launches["after_warm_up"]
    lines = [f"Triton specializations: {launches['warm_up']} in warm-up, {launches['served']} while serving, "
             f"{len(new)} of those not warmed up (a GPU compiles them while serving)"]
    for n in new[:10]:
        diff = n["differs_from_warm_up"]
        lines.append(f"  not warmed up: {n['kernel']}: " + ("never launched in warm-up" if diff is None
                                                            else "; ".join(diff)))
    return lines + ([f"  ... and {len(new) - 10} more (see the JSON)"] if len(new) > 10 else [])


def _warm_up_off_cuda(runner) -> None:
    """The runner warms up at start on CUDA only; elsewhere (the interpreter) do it here, so the launches after
    it mean the same on CPU as on a GPU."""
    if runner.device.type != "cuda":
        runner.warm_up()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"


def _tail(path: Path, max_chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-max_chars:]
    except OSError as exc:
        return f"({path.name} unreadable: {exc})"


def _plan(rows: list[int], prefix_lens: list[int], new_ids: list[list[int]], row_len: int, sample: list[bool]):
    """A BatchPlan of requests rows (decodes, one token each, must come first); request r's token at position p
    uses KV row r * row_len + p."""
    from lightserve.messages import BatchPlan

    num_decode = sum(1 for ids in new_ids if len(ids) == 1)
    kv_locs = [r * row_len + p + i for r, p, ids in zip(rows, prefix_lens, new_ids) for i in range(len(ids))]
    return BatchPlan(step=0, shm_indices=np.array(rows, np.int32), req_ids=np.array(rows, np.int64),
                     prefix_lens=np.array(prefix_lens, np.int32),
                     extend_lens=np.array([len(ids) for ids in new_ids], np.int32), sample=np.array(sample, bool),
                     input_ids=np.array([i for ids in new_ids for i in ids], np.int32),
                     kv_locs=np.array(kv_locs, np.int32), num_decode=num_decode)


def _device_time(fn, reps: int, device: torch.device) -> float:
    """Median seconds of fn: CUDA events on a GPU, the wall clock on CPU."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _load_hf(model_dir: str, device: torch.device):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(device.type)).to(device).eval()


def _write(out: str, name: str, report: dict) -> None:
    (Path(out) / name).write_text(json.dumps(report, indent=1, default=str))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode} during start-up (see server.log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy within {timeout} s (see server.log)")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the launcher (it stops its children and unlinks its shm), SIGKILL to its group if it hangs.
    Short waits: gpu_check.sh kills the group too once the stage has ended, however it ended."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(8)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait(5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("checkpoints", "runner", "server", "timings"):
        p = sub.add_parser(name)
        p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
        p.add_argument("--out", required=True, help="checkpoints: where to build them; others: the results folder")
        if name == "checkpoints":
            p.add_argument("--tokenizer", required=True, help="folder holding SmolLM2's tokenizer files")
        else:
            p.add_argument("--model", required=True)
        if name == "server":
            p.add_argument("--start-timeout", type=float, default=300.0)
            p.add_argument("--bench-timeout", type=float, default=150.0)
            p.add_argument("--pgid-file", help="append the server's process group id here (gpu_check.sh kills it)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        # The GPU code path on CPU: Triton's interpreter, which triton.jit reads when lightserve.kernels is first
        # imported (below, inside the stages); the server's launcher sets it for its workers itself.
        os.environ["TRITON_INTERPRET"] = "1"
    # A stage's time limit ends it with SIGTERM: exit through the finally blocks, so a server it started is
    # stopped (the server runs in its own session, out of reach of a signal to this process group).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    return {"checkpoints": cmd_checkpoints, "runner": cmd_runner, "server": cmd_server, "timings": cmd_timings}[
        args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
