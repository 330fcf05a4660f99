"""Tokenizer loading: load_tokenizer (transformers' AutoTokenizer for a model folder, without importing the model's
config class) and load_decoder (what the detokenizer decodes with, from a cache that needs no transformers at all).

`AutoTokenizer.from_pretrained(folder)` first builds the folder's config with AutoConfig, only to read its
model_type and tokenizer_class, and importing a config class (LlamaConfig and the rest) pulls in transformers'
model-loading modules and torch.distributed: 1.5 s of a 1.8 s tokenizer load on a Zen 3 core, paid at every start
by the HTTP front, the detokenizer, the grammar compiler and the offline pipeline alike. Where the folder's
tokenizer_config.json names its tokenizer class and carries no remote code, AutoTokenizer's choice of class reads
nothing more of the config than those fields (model_type, tokenizer_class, _name_or_path), so a bare config holding
them gives the same tokenizer. Any other folder (no tokenizer_class, an auto_map, no config.json, unreadable JSON)
goes through AutoTokenizer unchanged.

The detokenizer only decodes, and for most tokenizers (a fast tokenizer class that overrides neither decode nor
_decode, clean_up_tokenization_spaces off) transformers' decode is the Rust tokenizer's own. Importing transformers
(and torch through it) is then 2.8 s of CPU in a process that never needs them. So each load_tokenizer stores the
Rust tokenizer it built (`backend_tokenizer.to_str()`, the state after transformers' own adjustments to
tokenizer.json) under $LIGHTSERVE_CACHE/tokenizers, keyed by the folder's tokenizer files, the config's model_type
and tokenizer_class, and the transformers and tokenizers versions; load_decoder reads that entry back with the
`tokenizers` package alone, or loads through transformers where there is none (the first start of a folder, a
tokenizer whose decode transformers changes).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

from lightserve.envs import cache_root
from lightserve.log import get_logger

logger = get_logger(__name__)

# The files of a folder that can change what AutoTokenizer builds (config.json enters through two of its fields).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def load_tokenizer(model_dir: str | Path):
    """The tokenizer AutoTokenizer.from_pretrained(model_dir) gives."""
    from transformers import AutoTokenizer

    config = _bare_config(Path(model_dir))
    if config is None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, config=config)
    _store_decoder(Path(model_dir), tokenizer)
    return tokenizer


def load_decoder(model_dir: str | Path):
    """Something with `decode(ids, skip_special_tokens=...)` that decodes as load_tokenizer(model_dir)'s tokenizer
    does: the cached Rust tokenizer (a `tokenizers.Tokenizer`) where there is an entry, else that tokenizer."""
    entry = _entry_path(Path(model_dir))
    if entry is not None and entry.is_file():
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_str(entry.read_text())
        except Exception as exc:  # noqa: BLE001 - an unreadable or damaged entry: load as if there were none
            logger.warning("ignoring the cached tokenizer %s: %s", entry, exc)
    return load_tokenizer(model_dir)


def raw_decode_is_exact(tokenizer) -> bool:
    """True when the tokenizer's decode is its Rust tokenizer's (`backend_tokenizer.decode`) with nothing added: a
    fast tokenizer class that overrides neither decode nor _decode, with clean_up_tokenization_spaces off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


def _store_decoder(folder: Path, tokenizer) -> None:
    """Write the tokenizer's Rust state as the folder's cache entry where decoding needs nothing else; a cache that
    cannot be written only costs the next start its transformers import."""
    entry = _entry_path(folder)
    if entry is None or entry.is_file() or not raw_decode_is_exact(tokenizer):
        return
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(tokenizer.backend_tokenizer.to_str())
        os.replace(tmp, entry)  # atomic: a concurrent reader sees no entry or a whole one
    except OSError as exc:
        logger.debug("tokenizer cache not written (%s)", exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _entry_path(folder: Path) -> Path | None:
    """$LIGHTSERVE_CACHE/tokenizers/<key>.json, the key a hash of everything load_tokenizer's result depends on;
    None for a folder whose files cannot be read or that holds no tokenizer file."""
    digest = hashlib.sha256()
    found = 0
    try:
        for name in TOKENIZER_FILES:
            path = folder / name
            if path.is_file():
                digest.update(f"{name}\0{path.stat().st_size}\0".encode())
                digest.update(path.read_bytes())
                found += 1
        config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        versions = [metadata.version(pkg) for pkg in ("transformers", "tokenizers")]
    except (OSError, ValueError, metadata.PackageNotFoundError):
        return None
    if not found or not isinstance(config, dict):  # nothing of a tokenizer here to key an entry by
        return None
    fields = {"model_type": config.get("model_type"), "tokenizer_class": config.get("tokenizer_class"),
              "auto_map": config.get("auto_map"), "versions": versions}
    digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
    return cache_root() / "tokenizers" / f"{digest.hexdigest()[:32]}.json"


def _bare_config(folder: Path):
    """A PreTrainedConfig subclass instance with the folder's model_type, or None where AutoTokenizer needs more."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = model_config.get("model_type")
    if not (isinstance(tokenizer_config, dict) and isinstance(model_config, dict) and isinstance(model_type, str)
            and tokenizer_config.get("tokenizer_class") and "auto_map" not in tokenizer_config
            and "auto_map" not in model_config):
        return None
    from transformers import PreTrainedConfig

    # model_type is a class attribute of every config class, so the bare config gets a class of its own.
    bare = type("BareTokenizerConfig", (PreTrainedConfig,), {"model_type": model_type})()
    bare._name_or_path = str(folder)
    if model_config.get("tokenizer_class"):
        bare.tokenizer_class = model_config["tokenizer_class"]
    return bare
