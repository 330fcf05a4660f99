"""scripts/compare_vllm.sh end to end with a fake server standing in for lightserve (a few seconds).

`--python` points at a wrapper that answers `-m lightserve.launch_server` with fake_llm_server.py
and runs everything else with this interpreter, so the script's start-up, health wait, benchmark
runs, medians, JSON and clean-up are exercised without a model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parents[1] / "scripts" / "compare_vllm.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def setup(tmp_path: Path) -> dict:
    spec = importlib.util.spec_from_file_location("fake_llm_server", HERE / "fake_llm_server.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake.make_tiny_tokenizer(model / "tokenizer.json")
    wrapper = tmp_path / "py"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == -m && "$2" == lightserve.launch_server ]]; then\n'
        f'  env > "{tmp_path / "server.env"}"\n'
        f'  shift 2; exec "{sys.executable}" "{HERE / "fake_llm_server.py"}" "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return {"model": model, "python": wrapper, "out": tmp_path / "results" / "cmp.json", "port": _free_port(),
            "server_env": tmp_path / "server.env"}


def _run(setup: dict, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), "--only", "lightserve", "--port", str(setup["port"]), "--model-dir",
           str(setup["model"]),
           "--python", str(setup["python"]), "--out", str(setup["out"]), *extra]
    env = {**os.environ, "START_TIMEOUT": "60"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_compare_script_runs_and_cleans_up(setup: dict) -> None:
    proc = _run(setup, "--runs", "1", "--workloads", "W2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _port_open(setup["port"]), "the fake server outlived the script"
    res = json.loads(setup["out"].read_text())
    w2 = res["sides"]["lightserve"]["workloads"]["W2"]
    assert len(w2["runs"]) == 1 and w2["failed"] == 0
    assert all(r["completed"] == 16 and r["total_output_tokens"] == 16 * 64 for r in w2["runs"])
    assert w2["median"]["output tok/s"] > 0 and w2["median"]["TTFT mean ms"] > 0
    rows = [r for r in res["table"] if r["workload"] == "W2"]
    assert rows and all(r["vllm"] is None and r["ratio"] is None and r["lightserve"] is not None for r in rows)
    assert "TTFT mean ms" in proc.stdout and "wrote" in proc.stdout
    # Each run used its own seed, so the prompts differ between runs (no prefix-cache carry-over).
    runs = setup["out"].parent / "cmp_runs"  # the --out file's runs folder
    seeds = {json.loads((runs / f"lightserve-W2-{r}.json").read_text())["config"]["seed"] for r in ("warmup", "1")}
    assert len(seeds) == 2
    # --summarize-only starts no server and rebuilds the same medians from the run files.
    setup["out"].unlink()
    again = _run(setup, "--runs", "1", "--workloads", "W2", "--summarize-only", timeout=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting" not in again.stderr
    assert json.loads(setup["out"].read_text())["sides"]["lightserve"]["workloads"]["W2"]["median"] == w2["median"]


def test_compare_script_refuses_a_busy_port(setup: dict) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", setup["port"]))
        s.listen()
        proc = _run(setup, "--workloads", "W2", timeout=30)
    assert proc.returncode != 0 and "already in use" in proc.stderr


def test_compare_script_holds_the_server_to_an_older_isa(setup: dict) -> None:
    """--isa avx2: the server runs the AVX2 build of the C kernels, with torch and oneDNN held to AVX2 as well."""
    proc = _run(setup, "--runs", "1", "--workloads", "W2", "--isa", "avx2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(line.split("=", 1) for line in setup["server_env"].read_text().splitlines() if "=" in line)
    held = (env["LIGHTSERVE_CPU_BUILD"], env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"])
    assert held == ("avx2", "avx2", "AVX2")
    res = json.loads(setup["out"].read_text())["sides"]["lightserve"]
    assert (res["isa"], res["dtype"]) == ("avx2", "float32")  # auto: no native bf16 on an AVX2 CPU
    vllm_site = setup["out"].parent / "cmp_runs" / "isa_avx2" / "sitecustomize.py"
    assert "_is_avx512_supported = lambda: False" in vllm_site.read_text()
    bad = _run(setup, "--isa", "avx3", timeout=30)
    assert bad.returncode != 0 and "--isa must be native, avx512 or avx2" in bad.stderr
