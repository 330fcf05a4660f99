"""Routes for operators, load balancers and orchestrators: the liveness and readiness probes
(/health, /health_generate) and the model and server cards that sglang-router reads when a replica
registers (/get_model_info, /get_server_info, and SGLang's newer /model_info, /server_info).
docs/deploy.md maps them to Kubernetes probes.
"""
from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from starlette.responses import Response

from lightserve.http.front import ApiRouter, get_front, json_response

router = ApiRouter()

PROBE_PROMPT = "ok"  # /health_generate's prompt: one greedy token after it
try:
    VERSION = version("lightserve")
except PackageNotFoundError:  # run from a checkout without installing
    VERSION = "unknown"


@router.get("/health")
async def health(request: Request) -> Response:
    """Liveness, cheap: every process is up and the server is not draining. Never touches the engine."""
    front = get_front(request)
    reason = front.health()
    if reason is not None:
        return json_response({"status": "unavailable", "reason": reason}, 503)
    if front.drain.draining:
        return json_response({"status": "draining"}, 503, {"Retry-After": "1"})
    return json_response({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Readiness that means something: one real token through slot, router, worker and detokenizer
    within --health_generate_timeout_s (or any other request's token meanwhile), else 503. A wedged
    engine fails it while /health still passes. Concurrent calls share one probe request."""
    front = get_front(request)
    reason = front.health()
    if reason is None and front.drain.draining:
        return json_response({"status": "draining"}, 503, {"Retry-After": "1"})
    if reason is None:
        if front.probe is None or front.probe.done():
            ids = front.tokenizer.encode(PROBE_PROMPT, add_special_tokens=False)
            front.probe = asyncio.ensure_future(front.engine.probe(ids, front.config.health_generate_timeout_s))
        # shield: a client that gives up must not cancel the probe the others wait on
        reason = await asyncio.shield(front.probe)
    if reason is None:
        return json_response({"status": "ok"})
    return json_response({"status": "unavailable", "reason": reason}, 503)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> Response:
    """SGLang's model card, which routers (sglang-router) read when a worker registers."""
    front = get_front(request)
    return json_response({"model_path": front.model_dir or front.model_name, "tokenizer_path": front.model_dir or None,
                          "served_model_name": front.model_name, "is_generation": True,
                          "max_model_len": front.max_model_len})


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> Response:
    """The launch's settings in SGLang's spelling where one exists; sglang-router takes the model id
    from served_model_name and its tokenizer from tokenizer_path."""
    front = get_front(request)
    cfg = front.config
    return json_response({"served_model_name": front.model_name, "model_path": front.model_dir or front.model_name,
                          "tokenizer_path": front.model_dir or None, "tp_size": cfg.tp, "dp_size": 1,
                          "nnodes": cfg.nnodes, "context_length": front.max_model_len,
                          "max_total_num_tokens": cfg.kv_size or cfg.max_total_token_num,
                          "max_running_requests": cfg.running_max_req_size,
                          "chunked_prefill_size": cfg.chunked_prefill_size,
                          "disable_radix_cache": cfg.disable_prompt_cache,
                          "device": cfg.device.value, "kernel_backend": cfg.kernel_backend.value,
                          "dtype": cfg.data_type.value, "kv_cache_dtype": cfg.kv_cache_dtype.value,
                          "quant_activations": cfg.quant_activations.value,
                          "kv_bytes_per_token": cfg.kv_bytes_per_token,
                          "shutdown_grace_s": cfg.shutdown_grace_s, "version": VERSION})
