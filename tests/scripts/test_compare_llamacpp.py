"""scripts/compare_llamacpp.sh end to end with fake servers standing in for lightserve and llama-server.

`--python` points at a wrapper that answers `-m lightserve.launch_server` with fake_llm_server.py (after the
launcher's "started worker-tp0 pid N" line, naming itself) and runs everything else with this interpreter;
`--llama-server` at a wrapper that records its flags and runs the same fake. The script's argument handling, the
three sides per model, the float side shared by two GGUF files of one float folder, the RSS lines, the medians, the
JSON and the markdown table are exercised without a model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts.test_compare_vllm import _free_port, _port_open  # the same port helpers

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parents[1] / "scripts" / "compare_llamacpp.sh"
FAKE = HERE / "fake_llm_server.py"


@pytest.fixture
def setup(tmp_path: Path) -> dict:
    spec = importlib.util.spec_from_file_location("fake_llm_server", FAKE)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    hf = tmp_path / "m-hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    fake.make_tiny_tokenizer(hf / "tokenizer.json")
    for name in ("m.gguf", "m.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    python = tmp_path / "py"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == -m && "$2" == lightserve.launch_server ]]; then\n'
        f'  echo "$@" >> "{tmp_path / "lightserve.args"}"\n'
        '  echo "launcher: started worker-tp0 pid $$"\n'
        f'  shift 2; exec "{sys.executable}" "{FAKE}" "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    llama = tmp_path / "llama-server"
    llama.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == --version ]]; then echo "version: 1 (fake)"; exit 0; fi\n'
        f'echo "$@" >> "{tmp_path / "llama.args"}"\n'
        f'exec "{sys.executable}" "{FAKE}" "$@"\n'
    )
    for f in (python, llama):
        f.chmod(0o755)
    return {"tmp": tmp_path, "hf": hf, "python": python, "llama": llama, "out": tmp_path / "results" / "cmp.json",
            "port": _free_port()}


def _run(setup: dict, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    t = setup["tmp"]
    cmd = ["bash", str(SCRIPT), "--port", str(setup["port"]), "--python", str(setup["python"]),
           "--llama-server", str(setup["llama"]), "--out", str(setup["out"]), "--dtype", "float32",
           "--models", f"{t / 'm.gguf'},{t / 'm.Q8_0.gguf'}={setup['hf']}", *extra]
    env = {**os.environ, "START_TIMEOUT": "60"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_three_sides_per_model_and_the_table(setup: dict) -> None:
    proc = _run(setup, "--runs", "1", "--workloads", "W2", "--threads", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _port_open(setup["port"]), "a fake server outlived the script"
    t = setup["tmp"]
    res = json.loads(setup["out"].read_text())
    assert set(res["models"]) == {"m", "m.Q8_0"}
    for tag in ("m", "m.Q8_0"):
        sides = res["models"][tag]["sides"]
        assert set(sides) == {"gguf", "float", "llamacpp"}
        for entry in sides.values():
            w2 = entry["workloads"]["W2"]
            assert w2["failed"] == 0 and w2["runs"][0]["total_output_tokens"] == 16 * 64
            assert entry["rss_after_warmup_kb"] > 0 and entry["rss_kb"]["end"]["VmHWM"] > 0
        assert sides["llamacpp"]["version"] == "version: 1 (fake)"
        assert sides["llamacpp"]["ctx_per_slot"] == 512  # W2's 320 tokens rounded up to 256
    # Both GGUF files name one float folder (the first by the -hf rule): its float side ran once.
    assert res["models"]["m.Q8_0"]["sides"]["float"]["run_dir"].endswith("/m")
    ls_args = (t / "lightserve.args").read_text().splitlines()
    assert len(ls_args) == 3 and sum(f"--model_dir {setup['hf']} " in a for a in ls_args) == 1
    # The float side at --dtype, the GGUF side at lightserve's own choice (GGUF_DTYPE unset).
    assert [("--data_type float32" in a) for a in ls_args] == [f"--model_dir {setup['hf']} " in a for a in ls_args]
    llama_args = (t / "llama.args").read_text().splitlines()
    assert len(llama_args) == 2 and f"-m {t / 'm.gguf'} " in llama_args[0]
    for flags in ("--threads 3 ", "--parallel 64 ", "--cont-batching", "--no-kv-unified", f"-c {64 * 512} ",
                  "--threads-http 80"):
        assert flags in llama_args[0]
    assert "-kvu" not in llama_args[0].split()
    rows = [r for r in res["table"] if r["model"] == "m"]
    assert [r["metric"] for r in rows] == ["ITL p50 ms", "RSS MiB"]  # W2's row alone: W1 and W3 were not run
    assert rows[0]["gguf"] is not None and rows[0]["llamacpp"] is not None
    rss = rows[1]
    assert rss["gguf/llamacpp"] == pytest.approx(rss["gguf"] / rss["llamacpp"]) and rss["gguf/float"] > 0
    assert "| m.Q8_0 | W2 | ITL p50 ms |" in proc.stdout and "wrote" in proc.stdout
    run = json.loads((setup["out"].parent / "cmp_runs" / "m" / "llamacpp-W2-1.json").read_text())
    assert run["config"]["no_keep_alive"] is True  # llama-server closes the connection after each stream
    # --summarize-only starts no server and rebuilds the same table from the run files.
    setup["out"].unlink()
    again = _run(setup, "--runs", "1", "--workloads", "W2", "--summarize-only", timeout=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting" not in again.stderr
    assert json.loads(setup["out"].read_text())["table"] == res["table"]


@pytest.mark.parametrize("extra, message", [
    (("--only", "gguf,vllm"), "--only takes gguf, float and llamacpp"),
    (("--runs", "0"), "--runs must be a positive integer"),
    (("--workloads", "W9"), "unknown workload W9"),
    (("--models", "/nonexistent/x.gguf"), "no GGUF file /nonexistent/x.gguf"),
])
def test_bad_arguments_start_nothing(setup: dict, extra: tuple, message: str) -> None:
    proc = _run(setup, *extra, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr
    assert not (setup["tmp"] / "lightserve.args").exists() and not (setup["tmp"] / "llama.args").exists()
