"""vLLM's small utility routes, so clients and load balancers written for vLLM work unchanged:
GET /version and GET|POST /ping (SageMaker's liveness probe, answered like /health)."""
from __future__ import annotations

import importlib.metadata

from fastapi import Request
from starlette.responses import Response

from lightserve.http.front import ApiRouter, get_front, json_response

router = ApiRouter()


@router.get("/version")
async def version() -> Response:
    return json_response({"version": _VERSION})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    reason = get_front(request).health()
    if reason is None:
        return json_response({"status": "ok"})
    return json_response({"status": "unavailable", "reason": reason}, 503)


def _version() -> str:
    try:
        return importlib.metadata.version("lightserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown"


_VERSION = _version()
