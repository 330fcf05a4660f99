"""scripts/gpu_check.sh's dry run: every stage on CPU with small shapes, on the GPU code path (`--kernel_backend
triton`, Triton's interpreter): checkpoints built by transformers, the model runner and a real server against
transformers, the timing stage with its launch keys; so the GPU check cannot rot between GPU runs. Also the
pieces a GPU run depends on and the dry run cannot reach: the bandwidth table, the tie tolerance, the stage (c)
report of a server that never starts, and the killing of a previous run's server group."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
VERDICT = re.compile(r"^\((install|checkpoints|a|b|c|d)\) (PASS|FAIL|TIMEOUT) ")


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


gc = _load_gpu_check()


@pytest.mark.timeout(400)
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PY=sys.executable, OUT=str(out), WORK=str(work))
    # Its own process group: on a timeout the script gets SIGTERM and ends its stage and its server itself.
    proc = subprocess.Popen(["bash", "scripts/gpu_check.sh", "--device", "cpu"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=380)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").is_file() else output
    assert proc.returncode == 0, summary + _failed_logs(work / "results", summary)
    lines = summary.splitlines()
    verdicts = [line for line in lines if VERDICT.match(line)]
    assert [v.split()[0] for v in verdicts] == ["(checkpoints)", "(a)", "(b)", "(c)", "(d)"], summary
    assert all(v.split()[1] == "PASS" for v in verdicts), summary
    assert lines[-1].startswith("verdict after ") and lines[-1].endswith(": PASS"), summary
    # (a) collected the Triton kernel tests and deselected the C kernels' ones, without building them.
    assert re.search(r"\(a\) kernel tests: \d+/\d+ tests collected \(\d+ deselected\)", summary), summary
    # Only the summary and the archive in $OUT (the device tool brings back a few files); the archive holds the rest.
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = set(tar.getnames())
        reports = {s: json.load(tar.extractfile(f"results/stage_{s}.json")) for s in "bcd"}
    for name in ("summary.txt", "checkpoints.log", "a_kernels.log", "stage_a.xml", "b_runner.log", "c_server.log",
                 "server_c.log", "w1.json", "d_timings.log"):
        assert f"results/{name}" in names, (name, sorted(names))
    assert not (work / "server.pgid").exists()  # every server group recorded was stopped and forgotten

    runner = reports["b"]
    assert runner["ok"] is True and runner["kernel_backend"] == "triton", runner
    assert runner["launch_keys"]["served"] > 0, runner  # Triton kernels ran the steps (interpreted), no C kernel
    assert isinstance(runner["launch_keys"]["after_warm_up"], list)
    assert all(r["steps"] == runner["decode_steps"] + 1 for r in runner["requests"])
    assert runner["tie_steps_allowed"] == gc.TIE_STEPS[torch.float32] and runner["max_tie_gap_steps"] >= 0
    assert set(runner["phases"]) >= {"runner_start_s", "prefill_s", "decode_s", "transformers_load_s", "reference_s"}
    server = reports["c"]
    assert server["ok"] is True and server["kernel_backend"] == "triton" and server["error"] is None, server
    assert len(server["prompts"]) == 6 and server["shm_left"] == [] and server["w1_completed"] == 4
    timings = reports["d"]
    assert timings["ok"] is True and timings["kernel_backend"] == "triton", timings
    assert timings["hbm_peak_bytes_s"] is None and "not a GPU" in timings["hbm_peak_source"]
    assert [(d["batch"], d["context"]) for d in timings["decode"]] == [(1, 32), (1, 64), (4, 32), (4, 64)]
    assert all(d["step_ms"] > 0 and d["tok_s"] > 0 and d["attn_gb_s"] > 0 and d["attn_hbm_share"] is None
               for d in timings["decode"])
    assert timings["prefill"]["tokens"] == 64
    launches = timings["launch_keys"]
    assert launches["warm_up"] > 0 and launches["served"] > 0 and isinstance(launches["after_warm_up"], list)
    assert all(set(k) == {"kernel", "key", "differs_from_warm_up"} for k in launches["after_warm_up"])


def _failed_logs(results: Path, summary: str) -> str:
    """The last lines of the log of every stage whose verdict names one ("see NAME.log")."""
    tails = []
    for name in re.findall(r"see (\w+\.log)", summary):
        log = results / name
        if log.is_file():
            tails.append(f"\n--- {name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    return "".join(tails)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA H200", 4.8e12), ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA L40S", 0.864e12), ("NVIDIA GH200 480GB", None), ("NVIDIA H800", None), ("Tesla V100-SXM2-16GB", None)])
def test_hbm_peak_by_device_name_and_none_for_an_unknown_one(name, peak):
    got, source = gc.hbm_peak_bytes_s(name)
    assert got == peak
    assert ("unknown" in source) == (peak is None)


def test_tie_tolerance_grows_with_the_logit_and_is_tighter_in_float32():
    assert gc.logit_step(torch.bfloat16, torch.tensor([20.0, -20.0, 1.5, 0.01])).tolist() == [0.125, 0.125,
                                                                                                  2**-7, 2**-7]
    assert gc.TIE_STEPS[torch.float32] * torch.finfo(torch.float32).eps \
        < gc.TIE_STEPS[torch.bfloat16] * torch.finfo(torch.bfloat16).eps / 100
    # Transformers' top token is 0 on every row; ours is token 1, its logit 0.2 (bf16: 1.6 steps at 20) or 0.6
    # (4.8 steps) below the top, or equal to it.
    ref = torch.tensor([[20.0, 19.8, 0.0], [20.0, 19.4, 0.0], [20.0, 20.0, 0.0]])
    check = gc.compare_greedy(torch.tensor([1, 1, 1]), ref, torch.bfloat16)
    assert (check["tie_steps"], check["bad_steps"], check["first_bad"], check["ok"]) == (2, 1, 1, False)
    assert check["max_tie_gap"] == pytest.approx(0.2, abs=1e-5)
    assert check["max_tie_gap_steps"] == pytest.approx(1.6, abs=1e-4)
    assert check["max_bad_gap_steps"] == pytest.approx(4.8, abs=1e-4)
    strict = gc.compare_greedy(torch.tensor([1, 0, 1]), ref, torch.float32)
    assert (strict["tie_steps"], strict["bad_steps"], strict["first_bad"]) == (1, 1, 0)


@pytest.mark.timeout(120)
def test_stage_c_reports_a_server_that_never_starts(tmp_path):
    """The server exits at start (no model there): stage_c.json still says why, with the server's log tail, and
    the server's process group id was recorded for gpu_check.sh."""
    pgids = tmp_path / "server.pgid"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "server", "--device", "cpu",
                          "--model", str(tmp_path / "missing"), "--out", str(tmp_path), "--start-timeout", "60",
                          "--pgid-file", str(pgids)], capture_output=True, text=True, timeout=110, cwd=REPO)
    assert run.returncode == 1, run.stderr[-2000:]
    report = json.loads((tmp_path / "stage_c.json").read_text())
    assert report["ok"] is False and report["error"].startswith("start: "), report
    assert report["server_log_tail"], report
    assert re.fullmatch(r"\d+\n", pgids.read_text())
    assert "(c) server greedy vs transformers: FAIL" in run.stdout


@pytest.mark.timeout(120)
def test_a_run_first_kills_the_server_group_a_killed_run_left(tmp_path):
    """A server group recorded in $WORK/server.pgid by a run that was killed is SIGTERMed at the next run's start
    (here a run that then stops: no CUDA device), and the run still leaves its summary and archive."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        (work / "server.pgid").write_text(f"{leftover.pid}\n")
        env = dict(os.environ, PY=sys.executable, OUT=str(out), WORK=str(work), CUDA_VISIBLE_DEVICES="")
        run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=100)
        assert leftover.wait(timeout=5) == -signal.SIGTERM
    finally:
        if leftover.poll() is None:
            leftover.kill()
            time.sleep(0.1)
    assert run.returncode == 1, run.stdout + run.stderr
    assert not (work / "server.pgid").exists()
    summary = (out / "summary.txt").read_text()
    assert summary.rstrip().endswith("FAIL (no usable CUDA device)"), summary
    assert (out / "gpu_check.tar.gz").is_file()
