"""The model-worker process, one per tensor-parallel rank.

Each rank runs every BatchPlan the router sends. Rank 0 then hands the logits to its OutputWriter
(output_writer.py), which samples and publishes the tokens.
"""
from __future__ import annotations

import datetime
import os
import time
from multiprocessing.connection import Connection

import torch
import zmq

from lightserve.config import QuantActivations, ServerConfig, SpeculativeAlgorithm
from lightserve.log import get_logger
from lightserve.messages import BatchPlan, LoadLora, PrefetchLora, Shutdown, decode
from lightserve.model_infer.lora import LoraLimits
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.output_writer import OutputWriter
from lightserve.procutil import child_process, report_ready
from lightserve.shm.req_pool import ReqPool

logger = get_logger(__name__)

POLL_MS = 100
# Bounds the rendezvous (every rank of every node must join within it) and, for gloo and for nccl's
# watchdog, every later collective: a rank whose peer hangs errors out instead of waiting forever.
# A peer that dies closes its sockets, and gloo fails at once ("Connection closed by peer").
TP_TIMEOUT = datetime.timedelta(seconds=120)


def torch_dtype(name: str) -> torch.dtype:
    """A resolved --data_type, --kv_cache_dtype or --lora_dtype value as a torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]


def run_worker(config: ServerConfig, tp_rank: int, ready: Connection) -> None:
    """`config`: resolved: its model_dir and model facts (read once by the launcher) say what to load."""
    model_dir, model_config = config.model_dir, config.model_config
    with child_process(f"worker-tp{tp_rank}", config, ready) as stop:
        device = torch.device("cuda", tp_rank % config.ranks_per_node) if config.device.value == "cuda" \
            else torch.device("cpu")
        if device.type == "cpu":
            # The node's cores are split between its ranks; the other processes mostly sleep.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.ranks_per_node))
        else:
            torch.cuda.set_device(device)
        tp_group = _init_tp_group(config, tp_rank, device)
        pool = ReqPool.attach(config.shm_name) if tp_rank == 0 else None
        runner = ModelRunner(model_dir, model_config, torch_dtype(config.data_type.value), device, tp_rank,
                             config.tp, tp_group, num_req_rows=config.req_pool_size,
                             max_req_total_len=config.max_req_total_len,
                             kv_size=config.max_total_token_num, ranks_per_node=config.ranks_per_node,
                             kernel_backend=config.kernel_backend, max_step_tokens=config.batch_max_tokens,
                             kv_dtype=torch_dtype(config.kv_cache_dtype.value),
                             int8_activations=config.quant_activations is QuantActivations.INT8,
                             cuda_graph_max_batch=0 if config.disable_cudagraph else config.graph_max_batch_size,
                             lora=LoraLimits(config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                             torch_dtype(config.lora_dtype.value)) if config.enable_lora else None,
                             draft=(config.speculative_draft_model_dir, config.draft_model)
                             if config.draft_model is not None else None,
                             mtp=config.speculative_algorithm is SpeculativeAlgorithm.MTP)
        if tp_group is not None:
            # Every rank must agree on the KV size the router will allocate from.
            size = torch.tensor([runner.kv_size], dtype=torch.long, device=device)
            torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MIN)
            runner.kv_size = int(size.item())
        ctx = zmq.Context()
        plans = ctx.socket(zmq.PULL)
        plans.connect(config.plan_addr(tp_rank))
        writer = None
        if tp_rank == 0:
            to_router, to_detok = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
            to_router.connect(config.step_done_addr)
            to_detok.connect(config.detok_addr)
            writer = OutputWriter(pool, model_config, model_dir, to_router, to_detok, device,
                                  config.reasoning_parser)
        # Only a model with an argmax head (a float32 model on CPU), or a bf16 one on CPU (its logits then stay bf16,
        # which the C argmax reads), gains from knowing that a step's logits are read for their argmax alone;
        # elsewhere rank 0 does not look (about 50 us of a 64-row step). Which row counts the head screens,
        # argmax_logits decides.
        model = runner.model
        ask_argmax = writer is not None and (model.argmax_head is not None or (
            model.device.type == "cpu" and model.dtype == torch.bfloat16))
        report_ready(ready, {"kv_size": runner.kv_size, "kv_bytes_per_token": runner.kv_bytes_per_token})
        try:
            while not stop.is_set():
                if not plans.poll(POLL_MS):
                    continue
                msg = decode(plans.recv(copy=False))
                match msg:
                    case BatchPlan():
                        t0 = time.perf_counter()
                        if msg.pending_inputs.size:
                            # The router plans one step ahead only with tp 1 (router/process.py), where rank 0
                            # holds the tokens; another rank could not fill these rows.
                            writer.fill_pending_inputs(msg)
                        logits = runner.forward(msg, argmax_only=ask_argmax and writer.argmax_only(msg))
                        if writer is not None:
                            writer.write(msg, logits, time.perf_counter() - t0)
                    case LoadLora(lora_id=lora_id, path=path, slot=slot):
                        # Between two steps: the plan before ran with the slot's old adapter, the next runs with
                        # this one. The front read the whole adapter before serving it, so this does not fail.
                        runner.load_lora(lora_id, path, slot)
                    case PrefetchLora(lora_id=lora_id, path=path):
                        runner.prefetch_lora(lora_id, path)  # a background read; returns at once
                    case Shutdown():
                        break
                    case _:
                        logger.error("worker: unexpected message %r", type(msg).__name__)
        finally:
            plans.close(linger=0)
            if writer is not None:
                writer.close()
            ctx.term()
            if tp_group is not None:
                torch.distributed.destroy_process_group()


def _init_tp_group(config: ServerConfig, tp_rank: int, device: torch.device):
    if config.tp == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    addr = f"tcp://{config.nccl_host}:{config.nccl_port}"
    t0 = time.monotonic()
    try:
        # Rank 0 hosts the rendezvous store on nccl_port; the launchers of other nodes probe that
        # port to notice that node 0 is gone (launch_server._serve_worker_node).
        torch.distributed.init_process_group(backend, init_method=addr, rank=tp_rank, world_size=config.tp,
                                             timeout=TP_TIMEOUT)
    except Exception as exc:
        raise RuntimeError(f"rank {tp_rank}/{config.tp} could not join the {backend} group at {addr} within "
                           f"{TP_TIMEOUT.total_seconds():.0f} s (are all {config.nnodes} node(s) started "
                           f"with the same --tp/--nccl_host/--nccl_port?): {exc}") from exc
    logger.info("pid %d joined the %s group at %s as rank %d/%d in %.1f s", os.getpid(), backend, addr,
                tp_rank, config.tp, time.monotonic() - t0)
    return torch.distributed.group.WORLD
