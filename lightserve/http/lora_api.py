"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"}, answered as vLLM does (plain-text success), only with
--allow_runtime_lora_updating. The adapters themselves are the EngineClient's (engine/adapters.py)."""
from __future__ import annotations

from fastapi import Request
from starlette.responses import PlainTextResponse, Response

from lightserve.engine.adapters import AdapterError
from lightserve.http.front import ApiError, ApiRouter, Front, get_front, read_json

router = ApiRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    front = _updating_front(request)
    body = await read_json(request)
    name, path = _name(body, "lora_name"), _name(body, "lora_path")
    if name in front.model_names:
        raise ApiError(400, f"{name!r} is the base model's name", "lora_name")
    try:
        await front.engine.load_lora(name, path)
    except AdapterError as exc:
        raise ApiError(exc.status, str(exc), exc.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    front = _updating_front(request)
    name = _name(await read_json(request), "lora_name")
    try:
        front.engine.unload_lora(name)
    except AdapterError as exc:
        raise ApiError(exc.status, str(exc), exc.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _updating_front(request: Request) -> Front:
    front = get_front(request)
    if not front.config.allow_runtime_lora_updating:
        raise ApiError(404, "loading and unloading LoRA adapters at run time is off: start the server with "
                            "--enable_lora --allow_runtime_lora_updating", None, "not_found")
    return front


def _name(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ApiError(400, "is required (a non-empty string)", field)
    return value
