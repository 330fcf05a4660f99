"""A ServerConfig from outside: `parse_args` (the launcher's command line, a flag per field) and `make_config`
(the offline pipeline's keyword settings). Both read ServerConfig's fields, the one definition of every setting.

LightLLM's flag spellings (`--max_total_token_num`) are accepted along with dashed aliases.
"""
from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, Field, fields
from enum import Enum
from typing import Any, Sequence

from lightserve.config import ServerConfig


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = argparse.ArgumentParser(prog="lightserve-launch", description="Start a lightserve LLM server.")
    hints = typing.get_type_hints(ServerConfig)
    for f in cli_fields():
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        kind = str if f.metadata.get("nargs") else _base_type(hints[f.name])
        default = f.default if f.default is not MISSING else None
        help_text = f.metadata.get("help", "")
        if f.metadata.get("nargs"):
            parser.add_argument(*names, dest=f.name, nargs=f.metadata["nargs"], default=default, help=help_text)
        elif kind is bool:
            parser.add_argument(*names, dest=f.name, action="store_true", default=default, help=help_text)
        elif isinstance(kind, type) and issubclass(kind, Enum):
            parser.add_argument(*names, dest=f.name, type=kind, choices=list(kind), default=default,
                                help=f"{help_text} (default {default.value})")
        else:
            parser.add_argument(*names, dest=f.name, type=kind, default=default,
                                help=f"{help_text} (default {default})")
    ns = parser.parse_args(argv)
    for f in cli_fields():
        if f.metadata.get("nargs") and getattr(ns, f.name) is not None:
            setattr(ns, f.name, tuple(getattr(ns, f.name)))
    try:
        return ServerConfig(**vars(ns))
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def make_config(model_dir: str | os.PathLike | None = None, **server_args: Any) -> ServerConfig:
    """pipeline()'s settings as a ServerConfig: enum strings converted, unknown names refused."""
    hints = typing.get_type_hints(ServerConfig)
    names = [f.name for f in cli_fields() if f.name != "model_dir"]
    server_args.setdefault("log_level", "warning")
    for key, value in list(server_args.items()):
        if key not in names:
            raise TypeError(f"pipeline() got an unknown setting {key!r}; the settings are: {', '.join(names)}")
        enum_type = _enum_of(hints[key])
        if enum_type is not None and not isinstance(value, enum_type):
            try:
                server_args[key] = enum_type(value.lower() if isinstance(value, str) else value)
            except ValueError:
                raise ValueError(f"{key}: must be one of {[e.value for e in enum_type]}, got {value!r}") from None
    return ServerConfig(model_dir=None if model_dir is None else os.fspath(model_dir), **server_args)


def cli_fields() -> list[Field]:
    """The ServerConfig fields that are settings (not the instance id nor the values resolved at start)."""
    return [f for f in fields(ServerConfig) if f.name != "instance_id" and f.metadata.get("cli", True)]


def _base_type(annotation: Any) -> Any:
    # A resolved annotation without its None: `int | None` -> int.
    if typing.get_origin(annotation) is not None:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _enum_of(annotation: Any) -> type[Enum] | None:
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, Enum):
            return arg
    return None
