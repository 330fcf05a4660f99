"""OpenAI Responses API: POST /v1/responses."""
from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
