"""resolve_config: the launch's one ServerConfig with the defaults that need the machine or the model filled in.

The launcher (`launch_server`) and the offline pipeline call it once, before `EngineProcs` starts any process.
"""
from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

from lightserve.config import DEFAULT_MAX_REQ_TOTAL_LEN, Device, DType, KernelBackend, KVCacheDType, ServerConfig
from lightserve.engine.procs import StartError

# On CPU a prompt token costs ~2.5 ms of one step (SmolLM2-135M, 2 cores), and 512-row GEMMs already run
# at the kernel's full rate: a bigger budget buys no throughput, only longer steps, during which every
# running request's next token and every later prompt's first token wait (a 2,048-token step is ~5 s).
CPU_BATCH_MAX_TOKENS = 512
GPU_BATCH_MAX_TOKENS = 8192
# On CPU a step's time grows with every prompt token (its rows of every GEMM, its attention over the prefix), so a
# step that gathers ten 48-token prompts takes as long as one 480-token prompt, and every prompt arriving
# meanwhile waits for all of it. Past 128 prompt tokens a step takes in no further prompt: short prompts
# arriving apart start within a short step (W3's TTFT p50 fell to 0.46-0.60 of the old figure on Zen 4,
# docs/benchmarks.md), while a long prompt still fills the step alone.
CPU_PREFILL_JOIN_TOKENS = 128


def resolve_config(config: ServerConfig) -> ServerConfig:
    """Fill in the defaults that need the machine or the model: the model folder, its facts (config.json,
    read here once for every process), device, dtype, batch sizes, ports. Raises StartError naming what
    cannot be served."""
    import torch

    from lightserve.kernels.cpu import cpu_has_native_bf16
    from lightserve.model_infer.models import check_tp, read_model_config

    if config.model_dir is None:
        from lightserve.engine.model_prep import ensure_default_model
        model_dir = str(ensure_default_model())
    else:
        model_dir = str(Path(config.model_dir).expanduser())
        if not (Path(model_dir) / "config.json").is_file():
            raise StartError(f"--model_dir {model_dir}: no config.json there (expected a Hugging Face model folder)")
    try:
        model_config = read_model_config(model_dir)
    except (ValueError, KeyError) as exc:
        raise StartError(f"--model_dir {model_dir}: {exc}") from None
    device = config.device
    if device is Device.AUTO:
        device = Device.CUDA if torch.cuda.is_available() else Device.CPU
    if device is Device.CUDA and not torch.cuda.is_available():
        raise StartError("--device cuda: no CUDA device is available")
    backend = config.kernel_backend
    if backend is KernelBackend.AUTO:
        backend = KernelBackend.TRITON if device is Device.CUDA else KernelBackend.CPU
    if backend is KernelBackend.CPU and device is Device.CUDA:
        raise StartError("--kernel_backend cpu: the C kernels run on CPU only; use triton (or auto) with --device cuda")
    dtype = config.data_type
    if dtype is DType.AUTO:
        dtype = DType.BFLOAT16 if device is Device.CUDA or cpu_has_native_bf16() else DType.FLOAT32
    kv_dtype = config.kv_cache_dtype
    if kv_dtype is KVCacheDType.AUTO:
        kv_dtype = KVCacheDType(dtype.value)
    batch_max = config.batch_max_tokens or (GPU_BATCH_MAX_TOKENS if device is Device.CUDA else CPU_BATCH_MAX_TOKENS)
    join = config.prefill_join_tokens or (batch_max if device is Device.CUDA else CPU_PREFILL_JOIN_TOKENS)
    max_len = min(config.max_req_total_len or DEFAULT_MAX_REQ_TOTAL_LEN, model_config.max_context_len)
    nccl_port = config.nccl_port
    if config.tp > 1 and nccl_port == 0:
        if config.nnodes > 1:
            raise StartError("--nccl_port must be given when --nnodes > 1 (every node must use the same one)")
        nccl_port = _free_port_block(config.tp + 1)
    try:  # the model family's rules, before any rank starts (and hangs its peers)
        check_tp(model_config, config.tp)
    except ValueError as exc:
        raise StartError(f"--tp {config.tp} cannot split this model: {exc}") from None
    return replace(config, model_dir=model_dir, model=model_config, device=device, kernel_backend=backend,
                   data_type=dtype, kv_cache_dtype=kv_dtype,
                   batch_max_tokens=batch_max, chunked_prefill_size=config.chunked_prefill_size or batch_max,
                   prefill_join_tokens=join,
                   max_req_total_len=max_len, nccl_port=nccl_port,
                   served_model_name=config.served_model_name or (Path(model_dir).name,))


def _free_port_block(n: int) -> int:
    """A port p such that p .. p+n-1 look free (the TP rendezvous and the plan sockets)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base + 1, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise StartError("no free block of ports for the tensor-parallel group")
