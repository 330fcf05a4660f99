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
               capture, the KV size chosen, time outside the forward and Triton compiles after warm-up

`--device cpu` runs every stage on small shapes (the dry run tests/scripts/test_gpu_check.py makes part
of the test suite). The file is longer than 400 lines on purpose: it is the one script a GPU run
carries, and its stages share the helpers at the bottom.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 4.8e12   # the H200's HBM3e bandwidth
# A greedy token may differ from transformers' where transformers' own logits leave it within this of the top.
TIE_TOL = 1e-2
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
    w1_args: tuple[str, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    timed_steps: int
    timing_prefill: int

    @staticmethod
    def for_device(device: str) -> Shapes:
        if device == "cuda":
            return Shapes(8192, 2048, 64, (100, 1000), 16, 32,
                          ("--num-prompts", "128", "--input-len-min", "128", "--input-len-max", "512",
                           "--output-len", "128", "--max-concurrency", "64"),
                          (1, 64, 256), (1024, 8192), 20, 8192)
        return Shapes(96, 32, 4, (10, 20), 16, 4,
                      ("--num-prompts", "4", "--input-len-min", "16", "--input-len-max", "32",
                       "--output-len", "4", "--max-concurrency", "4"),
                      (1, 4), (64, 128), 2, 128)


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
        print(f"checkpoint {name}: {sum(p.stat().st_size for p in out.iterdir()) / 2**30:.2f} GiB in "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------------------
# (b) the model runner against transformers
# ---------------------------------------------------------------------------------------------------------

def cmd_runner(args: argparse.Namespace) -> int:
    from lightserve.model_infer.forward_batch import make_forward_batch
    from lightserve.model_infer.model_runner import ModelRunner
    from lightserve.model_infer.models import read_model_config

    shapes = Shapes.for_device(args.device)
    device, dtype = torch.device(args.device), _dtype(args.device)
    cfg = read_model_config(args.model)
    lens = (shapes.prefill_len, *shapes.extra_prompts)
    max_len = shapes.prefill_len + shapes.decode_steps + 8
    # One spare request row, so the graphs are captured at 1, 2 and 4 and the 3 decoding requests replay padded.
    runner = ModelRunner(args.model, cfg, dtype, device, 0, 1, None, num_req_rows=len(lens) + 1,
                         max_req_total_len=max_len, kv_size=(len(lens) + 1) * max_len,
                         cuda_graph_max_batch=4 if device.type == "cuda" else 0)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    ours: list[list[torch.Tensor]] = [[] for _ in lens]   # our logits after each prompt, then each decode step
    # Chunked prefill, one request at a time; the last chunk samples.
    for r, seq in enumerate(seqs):
        for start in range(0, len(seq), shapes.prefill_chunk):
            chunk = seq[start:start + shapes.prefill_chunk]
            last = start + len(chunk) == len(seq)
            logits = runner.forward(_plan([r], [start], [chunk], max_len, sample=[last]))
            if last:
                ours[r].append(logits[0].float().cpu())
    graph_mismatches, graph_steps = 0, 0
    for _ in range(shapes.decode_steps):
        for r in range(len(seqs)):
            seqs[r].append(int(ours[r][-1].argmax()))
        rows = list(range(len(seqs)))
        plan = _plan(rows, [len(s) - 1 for s in seqs], [[s[-1]] for s in seqs], max_len, sample=[True] * len(seqs))
        batch = make_forward_batch(plan, runner.kv_cache.req_to_token, runner.staging)
        graphs = runner.graph_runner
        if graphs is not None and graphs.can_run(batch):
            # The replay against an eager forward of the same padded inputs: same kernels, same shapes.
            replayed = graphs.run(batch).clone()
            eager = runner.model.forward(graphs.inputs.batch(_size(graphs, batch)), runner.kv_cache)[:batch.num_reqs]
            graph_steps += 1
            graph_mismatches += int(not torch.equal(replayed, eager))
            logits = replayed
        else:
            logits = runner.model.forward(batch, runner.kv_cache)
        for r in range(len(seqs)):
            ours[r].append(logits[r].float().cpu())
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = _load_hf(args.model, device)
    report: dict = {"prefill_len": shapes.prefill_len, "chunk": shapes.prefill_chunk,
                    "decode_steps": shapes.decode_steps, "requests": []}
    ok = graph_mismatches == 0
    for r, seq in enumerate(seqs):
        prompt_len = lens[r]
        with torch.no_grad():
            # Teacher-forced on our tokens: logits at positions prompt_len - 1 .. len(seq) - 1.
            ref = hf(input_ids=torch.tensor([seq], device=device)).logits[0, prompt_len - 1:].float().cpu()
        mine = torch.stack(ours[r])                                        # [steps + 1, V]
        check = compare_greedy(mine.argmax(-1), ref)
        check["max_abs_logit_diff"] = float((mine - ref).abs().max())
        report["requests"].append({"prompt_len": prompt_len, **check})
        ok &= check["ok"]
    report.update(graph_steps=graph_steps, graph_mismatches=graph_mismatches, ok=ok)
    _write(args.out, "stage_b.json", report)
    worst = max(q["max_abs_logit_diff"] for q in report["requests"])
    print(f"(b) runner vs transformers: {'PASS' if ok else 'FAIL'}; greedy mismatches outside ties "
          f"{sum(q['bad_steps'] for q in report['requests'])}, ties {sum(q['tie_steps'] for q in report['requests'])}, "
          f"max |logit diff| {worst:.3g}; graph replay vs eager: {graph_mismatches}/{graph_steps} steps differ")
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
    import httpx

    shapes = Shapes.for_device(args.device)
    device = torch.device(args.device)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(args.out) / "server.log", "wb")
    cmd = [sys.executable, "-m", "lightserve.launch_server", "--model_dir", args.model, "--device", args.device,
           "--port", str(port), "--data_type", "bfloat16" if args.device == "cuda" else "float32",
           "--max_req_total_len", "2048"]
    server = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    report: dict = {"prompts": []}
    ok = False
    try:
        _wait_healthy(server, url, args.start_timeout)
        outs = []
        with httpx.Client(timeout=120) as client:
            for text in PROMPTS[:shapes.num_prompts]:
                body = {"inputs": text, "parameters": {"do_sample": False, "max_new_tokens": shapes.new_tokens,
                                                       "ignore_eos": True, "return_details": True}}
                resp = client.post(url + "/generate", json=body)
                resp.raise_for_status()
                outs.append([t["id"] for t in resp.json()["tokens"]])
        bench = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_serving.py"), "--backend", "openai",
                                "--base-url", url, "--tokenizer", args.model, "--dataset", "random",
                                "--request-rate", "inf", *shapes.w1_args, "--no-progress",
                                "--output-json", str(Path(args.out) / "w1.json")],
                               capture_output=True, text=True, timeout=args.bench_timeout)
        (Path(args.out) / "w1.txt").write_text(bench.stdout + bench.stderr)
        report["w1_rc"] = bench.returncode
    finally:
        _stop(server)
        log.close()
    leftovers = [p.name for p in Path("/dev/shm").glob("lightserve-*") if str(server.pid) in p.name]
    report["shm_left"] = leftovers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    hf = _load_hf(args.model, device)
    ok = report["w1_rc"] == 0 and not leftovers and server.returncode is not None
    for text, ids in zip(PROMPTS, outs):
        prompt = tok(text).input_ids
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt + ids[:-1]], device=device)).logits[0, len(prompt) - 1:]
        check = compare_greedy(torch.tensor(ids), ref.float().cpu())
        report["prompts"].append({"prompt_len": len(prompt), **check})
        ok &= check["ok"]
    w1_path = Path(args.out) / "w1.json"
    w1 = json.loads(w1_path.read_text())["aggregates"] if w1_path.is_file() else {}
    ok &= w1.get("failed") == 0 and w1.get("completed", 0) > 0
    report.update(w1_output_tok_s=w1.get("output_throughput"), w1_completed=w1.get("completed"),
                  w1_failed=w1.get("failed"), server_exit=server.returncode, ok=ok)
    _write(args.out, "stage_c.json", report)
    print(f"(c) server greedy vs transformers: {'PASS' if ok else 'FAIL'}; "
          f"{sum(p['bad_steps'] for p in report['prompts'])} mismatches outside ties over {len(outs)} prompts; "
          f"W1 rc {report['w1_rc']}, {report['w1_completed']} done, {report['w1_failed']} failed, "
          f"output {report['w1_output_tok_s'] or 0:.0f} tok/s; shm left: {leftovers or 'none'}")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------
# (d) timings on the 8B shape
# ---------------------------------------------------------------------------------------------------------

def cmd_timings(args: argparse.Namespace) -> int:
    from lightserve.kernels.decode_attention import decode_attention_triton
    from lightserve.model_infer.model_runner import ModelRunner
    from lightserve.model_infer.models import read_model_config

    shapes = Shapes.for_device(args.device)
    device, dtype = torch.device(args.device), _dtype(args.device)
    cuda = device.type == "cuda"
    cfg = read_model_config(args.model)
    max_batch, max_ctx = max(shapes.batches), max(max(shapes.contexts), shapes.timing_prefill)
    row_len = max_ctx + 8
    t0 = time.perf_counter()
    runner = ModelRunner(args.model, cfg, dtype, device, 0, 1, None, num_req_rows=max_batch, max_req_total_len=row_len,
                         kv_size=None if cuda else max_batch * row_len, cuda_graph_max_batch=max_batch if cuda else 0)
    report: dict = {"start_s": time.perf_counter() - t0, "kv_size": runner.kv_size,
                    "kv_gib": runner.kv_size * runner.model.kv_bytes_per_token() / 2**30}
    assert runner.kv_size >= max_batch * row_len, ("KV cache too small for the timed shapes", runner.kv_size)
    if runner.graph_runner is not None:
        report.update(graph_capture_s=runner.graph_runner.capture_s,
                      graph_capture_mib=runner.graph_runner.capture_bytes / 2**20)
    compiles = CompileCounter()
    with compiles:
        # Row b's tokens sit at KV rows b * row_len + position: contiguous, like a fresh cache.
        table = runner.kv_cache.req_to_token                                  # [max_batch, row_len]
        table.copy_(torch.arange(max_batch * row_len, dtype=torch.int32, device=device).view(max_batch, row_len))
        report["decode"] = []
        for batch in shapes.batches:
            for ctx in shapes.contexts:
                report["decode"].append(_time_decode(runner, batch, ctx, row_len, shapes.timed_steps,
                                                     decode_attention_triton if cuda else None))
        report["prefill"] = _time_prefill(runner, shapes.timing_prefill, row_len)
    report["triton_compiles_after_warm_up"] = compiles.names if compiles.available else "not counted (triton < 3.4)"
    _write(args.out, "stage_d.json", report)
    for d in report["decode"]:
        print(f"(d) decode batch {d['batch']:>3} ctx {d['context']:>5}: {d['step_ms']:7.2f} ms/step, "
              f"{d['tok_s']:9.0f} tok/s, outside forward {d['outside_share']:.1%}"
              + (f", attention {d['attn_gb_s']:.0f} GB/s = {d['attn_hbm_share']:.0%} of HBM"
                 if d.get("attn_gb_s") else ""))
    p = report["prefill"]
    print(f"(d) prefill {p['tokens']} tokens: {p['ms']:.1f} ms, {p['tok_s']:.0f} tok/s; KV {report['kv_size']} tokens "
          f"({report['kv_gib']:.1f} GiB); graphs {report.get('graph_capture_s', 0):.1f} s, "
          f"{report.get('graph_capture_mib', 0):.0f} MiB; Triton compiles after warm-up: {len(compiles.names)}")
    return 0 if not compiles.names else 1


def _time_decode(runner, batch: int, ctx: int, row_len: int, steps: int, attention) -> dict:
    rows = list(range(batch))
    ids = np.random.default_rng(batch).integers(3, runner.model_config.vocab_size, batch)
    plan = _plan(rows, [ctx - 1] * batch, [[int(i)] for i in ids], row_len, sample=[True] * batch)
    step_s = []
    for i in range(steps + 2):                               # 2 untimed
        t0 = time.perf_counter()
        logits = runner.forward(plan)
        logits.argmax(-1).cpu()                              # the worker's one read-back
        if i >= 2:
            step_s.append(time.perf_counter() - t0)
    step = float(np.median(step_s))
    forward = _forward_only_s(runner, plan, steps)
    out = {"batch": batch, "context": ctx, "step_ms": step * 1e3, "forward_ms": forward * 1e3,
           "tok_s": batch / step, "outside_share": max(0.0, 1 - forward / step)}
    if attention is not None:
        out.update(_time_attention(runner, batch, ctx, attention))
    return out


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


def _time_attention(runner, batch: int, ctx: int, attention) -> dict:
    kv = runner.kv_cache
    shards = runner.model.weights.shards
    q = torch.randn(batch, shards.num_heads, runner.model_config.head_dim, dtype=runner.dtype, device=runner.device)
    rows = torch.arange(batch, dtype=torch.int32, device=runner.device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=runner.device)
    scale = runner.model_config.head_dim ** -0.5
    seconds = _device_time(lambda: attention(q, kv.k_caches[0], kv.v_caches[0], kv.req_to_token, rows, lens, ctx,
                                             scale), 10, runner.device)
    bytes_read = 2 * batch * ctx * kv.k_caches[0][0].numel() * kv.k_caches[0].element_size()   # K and V
    return {"attn_us": seconds * 1e6, "attn_gb_s": bytes_read / seconds / 1e9,
            "attn_hbm_share": bytes_read / seconds / HBM_BYTES_PER_S}


def _time_prefill(runner, tokens: int, row_len: int) -> dict:
    ids = np.random.default_rng(1).integers(3, runner.model_config.vocab_size, tokens).tolist()
    plan = _plan([0], [0], [ids], row_len, sample=[True])
    runner.forward(plan)
    seconds = _device_time(lambda: runner.forward(plan), 3, runner.device)
    return {"tokens": tokens, "ms": seconds * 1e3, "tok_s": tokens / seconds}


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------

def compare_greedy(ids: torch.Tensor, ref_logits: torch.Tensor) -> dict:
    """ids [N]: our greedy tokens; ref_logits [N, V]: transformers' logits at the same positions (teacher-forced
    on our tokens). A token other than transformers' top one passes when its logit is within TIE_TOL of it."""
    ref_logits = ref_logits.float()
    top = ref_logits.max(-1).values                                         # [N]
    ours = ref_logits.gather(1, ids.long()[:, None])[:, 0]                 # [N]
    differs = ids != ref_logits.argmax(-1)
    tie = differs & (top - ours < TIE_TOL)
    bad = differs & ~tie
    return {"steps": int(ids.numel()), "tie_steps": int(tie.sum()), "bad_steps": int(bad.sum()),
            "first_bad": int(bad.nonzero()[0]) if bool(bad.any()) else None, "ok": not bool(bad.any())}


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
    """SIGTERM to the launcher (it stops its children and unlinks its shm), SIGKILL to the group if it hangs."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


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
    args = ap.parse_args(argv)
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
