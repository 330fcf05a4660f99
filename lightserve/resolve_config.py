"""resolve_config: the launch's one ServerConfig with the defaults that need the machine or the model filled in.

The launcher (`launch_server`) and the offline pipeline call it once, before `EngineProcs` starts any process.
"""
from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

from lightserve.config import (
    DEFAULT_MAX_REQ_TOTAL_LEN,
    Device,
    DType,
    KernelBackend,
    KVCacheDType,
    ServerConfig,
    SpeculativeAlgorithm,
)
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
    read here once for every process), device, dtype, batch sizes, ports. A GGUF model (a .gguf --model_dir, a folder
    holding one, or the bundled default on the CPU backend) resolves to its HF metadata folder and `gguf_file`.
    Raises StartError naming what cannot be served."""
    import torch

    from lightserve.kernels.cpu import cpu_has_native_bf16
    from lightserve.model_infer.models import check_gguf, check_tp, read_model_config

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
    model_dir, gguf_file, name = _model_source(config.model_dir, backend)
    try:
        model_config = read_model_config(model_dir)
    except (ValueError, KeyError) as exc:
        raise StartError(f"--model_dir {config.model_dir or gguf_file}: {exc}") from None
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
    if model_config.quantization and backend is not KernelBackend.CPU:
        raise StartError(f"--model_dir {config.model_dir}: quantized weights are served packed on CPU only (the C "
                         "kernels); use --device cpu with --kernel_backend cpu (or auto)")
    packed_gguf = False
    if gguf_file is not None:  # its tensor types and block boundaries, before any rank fails on them
        try:
            packed_gguf = check_gguf(gguf_file, model_config, config.tp)
        except ValueError as exc:
            raise StartError(f"--model_dir {config.model_dir or gguf_file}: {exc}") from None
    quantized_base = packed_gguf or bool(model_config.quantization)
    dtype = config.data_type
    if dtype is DType.AUTO:
        # Weights kept in blocks (a GGUF file, an int8 / int4 checkpoint) multiply float32 activations in their C
        # kernels, and the one-call decoder layers take them with float32 activations only: on CPU bf16 activations
        # only add conversions around every projection there (Intel Xeon with AMX, the bundled Q4_1 file with int8
        # activations, float32 against bf16: W2 inter-token p50 6.25 against 11.33 ms, W1 309 against 295 output
        # tok/s, W3 TTFT p50 314 against 392 ms; docs/quantization.md).
        native_bf16 = device is Device.CUDA or (cpu_has_native_bf16() and not quantized_base)
        dtype = DType.BFLOAT16 if native_bf16 else DType.FLOAT32
    kv_dtype = config.kv_cache_dtype
    if kv_dtype is KVCacheDType.AUTO:
        kv_dtype = KVCacheDType(dtype.value)
    lora_dtype = config.lora_dtype
    if lora_dtype is DType.AUTO:
        # Beside packed 4- or 8-bit weights on CPU, float32 adapter stacks are a large share of what a batch-1 step
        # reads (rank 16 on every projection of SmolLM2: 19.5 MB against its 85 MB Q4_1 file), and their bytes
        # bound the LoRA products there; bf16 halves them, an error (one rounding of A and scaling * B, products
        # summed in float32) far below the base weights' own quantization.
        lora_dtype = DType.BFLOAT16 if device is Device.CPU and dtype is DType.FLOAT32 and quantized_base else dtype
    if config.enable_lora:
        _check_lora_modules(config, model_config, name)
    if config.speculative_algorithm is SpeculativeAlgorithm.MTP:
        _check_mtp(model_dir, gguf_file, model_config)
    draft_dir = draft_gguf = draft_config = None
    if config.speculative_draft_model_dir is not None:
        draft_dir, draft_gguf, draft_config = _draft_model(config, backend, model_dir, model_config, max_len)
    return replace(config, model_dir=model_dir, gguf_file=gguf_file, model=model_config, device=device,
                   speculative_draft_model_dir=draft_dir, draft_gguf_file=draft_gguf, draft_model=draft_config,
                   kernel_backend=backend,
                   data_type=dtype, kv_cache_dtype=kv_dtype, lora_dtype=lora_dtype,
                   batch_max_tokens=batch_max, chunked_prefill_size=config.chunked_prefill_size or batch_max,
                   prefill_join_tokens=join,
                   max_req_total_len=max_len, nccl_port=nccl_port,
                   served_model_name=config.served_model_name or (name,))


def _check_mtp(model_dir: str, gguf_file: str | None, model_config) -> None:
    """--speculative_algorithm mtp on a model with a multi-token-prediction layer in safetensors; StartError naming
    the flag otherwise."""
    from safetensors import safe_open

    from lightserve.model_infer.models import mtp_layer_index

    try:
        index = mtp_layer_index(model_config)
    except ValueError as exc:
        raise StartError(str(exc)) from None
    if gguf_file is not None or model_config.quantization:
        raise StartError("--speculative_algorithm mtp: the multi-token-prediction layer is read from float "
                         "safetensors checkpoints only")
    wanted = f"model.layers.{index}.eh_proj.weight"
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            if wanted in f.keys():  # noqa: SIM118 (not iterable)
                return
    raise StartError(f"--speculative_algorithm mtp: the checkpoint has no {wanted} (its config.json names an MTP "
                     "layer whose weights are not there)")


def _draft_model(config: ServerConfig, backend: KernelBackend, model_dir: str, model_config, max_len: int):
    """--speculative_draft_model_dir resolved as --model_dir is: (its HF folder, its GGUF file or None, its
    ModelConfig), checked against the served model before any process starts: the same vocabulary (size and every
    token's id in the tokenizer), a context of at least --max_req_total_len, a split over --tp. StartError naming
    the flag otherwise."""
    from lightserve.hf_tokenizer import load_tokenizer
    from lightserve.model_infer.models import check_gguf, check_tp, read_model_config

    flag = "speculative_draft_model_dir"
    given = config.speculative_draft_model_dir
    draft_dir, draft_gguf, _ = _model_source(given, backend, flag)
    try:
        draft = read_model_config(draft_dir)
        check_tp(draft, config.tp)
        if draft_gguf is not None:
            check_gguf(draft_gguf, draft, config.tp)
    except (ValueError, KeyError) as exc:
        raise StartError(f"--{flag} {given}: {exc}") from None
    if draft.quantization and backend is not KernelBackend.CPU:
        raise StartError(f"--{flag} {given}: quantized weights are served packed on CPU only (the C kernels)")
    if draft.vocab_size != model_config.vocab_size:
        raise StartError(f"--{flag} {given}: a vocabulary of {draft.vocab_size} tokens, the served model's has "
                         f"{model_config.vocab_size}; the draft model must share its tokenizer")
    try:
        vocabs = [load_tokenizer(folder).get_vocab() for folder in (draft_dir, model_dir)]
    except (OSError, ValueError) as exc:
        raise StartError(f"--{flag} {given}: cannot compare its tokenizer with the served model's: {exc}") from None
    if vocabs[0] != vocabs[1]:
        raise StartError(f"--{flag} {given}: its tokenizer maps tokens to other ids than the served model's; the draft "
                         "model must share its tokenizer")
    if draft.max_context_len < max_len:
        raise StartError(f"--{flag} {given}: a context of {draft.max_context_len} positions, shorter than "
                         f"--max_req_total_len {max_len}; lower --max_req_total_len")
    return draft_dir, draft_gguf, draft


def _check_lora_modules(config: ServerConfig, model_config, model_name: str) -> None:
    """--enable_lora on a family that takes adapters, and every --lora_modules adapter read whole and checked
    against the model, before any process starts. StartError naming the flag, the adapter and what is wrong."""
    from lightserve.lora_adapter import LoraAdapterError, load_lora_tensors, lora_target_modules, read_lora_adapter

    try:
        lora_target_modules(model_config)
    except ValueError as exc:
        raise StartError(str(exc)) from None
    base_names = set(config.served_model_name or (model_name,))
    seen: set[str] = set()
    for name, path in config.lora_items:
        if name in seen or name in base_names:
            why = "given twice" if name in seen else "the base model's name"
            raise StartError(f"--lora_modules {name}={path}: {name!r} is {why}")
        seen.add(name)
        try:
            load_lora_tensors(read_lora_adapter(path, model_config, config.max_lora_rank))
        except LoraAdapterError as exc:
            raise StartError(f"--lora_modules {name}={path}: {exc}") from None


def _model_source(given: str | None, backend: KernelBackend,
                  flag: str = "model_dir") -> tuple[str, str | None, str]:
    """(the HF folder every process reads, the GGUF weights file or None, the default served name) of a model given
    as `given` (--model_dir, or `flag` naming another model's path; None = the bundled default). The bundled default
    model is its GGUF on the CPU backend, its float32 conversion elsewhere (GGUF runs on CPU only)."""
    from lightserve.engine import model_prep
    from lightserve.model_infer.models import gguf_weights

    if given is None:
        if backend is not KernelBackend.CPU:
            return str(model_prep.ensure_default_model()), None, model_prep.MODEL_NAME
        gguf_file = model_prep.default_gguf()
        return str(model_prep.prepare_gguf(gguf_file)), str(gguf_file), model_prep.MODEL_NAME
    path = Path(given).expanduser()
    try:
        gguf_file = gguf_weights(path) if path.exists() else None
    except ValueError as exc:
        raise StartError(f"--{flag} {exc}") from None
    if gguf_file is None:
        if not (path / "config.json").is_file():
            raise StartError(f"--{flag} {path}: no config.json there (expected a Hugging Face model folder or a "
                             ".gguf file)")
        return str(path), None, path.name
    if backend is not KernelBackend.CPU:
        raise StartError(f"--{flag} {gguf_file}: GGUF weights are served quantized on CPU only (the C kernels); "
                         f"use --device cpu with --kernel_backend cpu (or auto), or an HF safetensors folder")
    try:
        model_dir = model_prep.prepare_gguf(gguf_file)
    except (ValueError, KeyError, OSError) as exc:
        raise StartError(f"--{flag} {gguf_file}: cannot read its metadata: {exc}") from None
    return str(model_dir), str(gguf_file), gguf_file.stem


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
