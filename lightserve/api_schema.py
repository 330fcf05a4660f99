"""The request schemas' shared base: strict JSON types, unknown fields ignored.

Route modules subclass `StrictModel` for their request bodies; `front.parse_model` turns a
validation error into a 400 naming the field.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Request schemas: JSON types are checked strictly ("16" is not an int); unknown fields are ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")
