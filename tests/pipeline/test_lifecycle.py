"""Pipeline lifecycle: close() drains (calls in flight finish within shutdown_grace_s, the rest end
with an "abort" chunk) and, like interpreter exit, leaves no process and no shared memory; a second
pipeline starts in the same interpreter, and a dead child fails calls instead of hanging."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightserve import GenerationConfig, pipeline
from lightserve.engine.generation import EngineDead
from tests.e2e.server import RUNTIME_DIRS, files_left, lightserve_files
from tests.pipeline.helpers import SETTINGS, instance_files, wait_until

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 2.0


def _run_script(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_close_drains_frees_everything_then_a_second_pipeline_runs_and_survives_a_dead_child():
    before = lightserve_files()  # a pipeline's files are named after this process: lightserve-<our pid>-...
    first = pipeline(**SETTINGS, shutdown_grace_s=GRACE_S)
    iid, pids = first.config.instance_id, [c.proc.pid for c in first._procs.children]
    assert len(pids) == 3 and _has_segment_and_sockets(instance_files(iid))
    assert first.infer("Hello", GenerationConfig(max_new_tokens=4, ignore_eos=True)).generated_tokens == 4
    short = first.stream_infer("Count to ten:", GenerationConfig(max_new_tokens=6, ignore_eos=True))
    busy = first.stream_infer("Count to a million:", GenerationConfig(max_new_tokens=4000, ignore_eos=True))
    next(short)
    next(busy)
    t0 = time.monotonic()
    first.close()  # drains: the short stream runs to its end, the long one is aborted after the grace
    assert GRACE_S <= time.monotonic() - t0 < GRACE_S + 15
    rest = list(short)
    assert rest[-1].finish_reason == "length" and rest[-1].generated_tokens == 6
    last = list(busy)[-1]
    assert last.finish_reason == "abort" and 0 < last.generated_tokens < 4000
    first.close()  # idempotent
    assert not [p for p in pids if _alive(p)] and files_left(before, [os.getpid(), *pids]) == []
    with pytest.raises(RuntimeError, match="closed"):
        first.infer("Hello")

    with pipeline(**SETTINGS) as second:
        iid2 = second.config.instance_id
        children = {c.name: c.proc.pid for c in second._procs.children}
        cfg = GenerationConfig(max_new_tokens=4000, ignore_eos=True)
        gen = second.stream_infer(["Count to a million:", "Name every star:"], cfg)
        next(gen)
        outcome: list = []

        def consume() -> None:
            try:
                for _ in gen:
                    pass
                outcome.append("finished")
            except Exception as exc:  # noqa: BLE001 - asserted below: must be EngineDead
                outcome.append(exc)

        consumer = threading.Thread(target=consume)
        consumer.start()
        os.kill(children["worker-tp0"], signal.SIGKILL)
        consumer.join(30)
        assert not consumer.is_alive() and isinstance(outcome[0], EngineDead), outcome
        assert "worker-tp0" in str(outcome[0])
        with pytest.raises(EngineDead, match="worker-tp0"):
            second.infer("Hello")
    assert not [p for p in children.values() if _alive(p)]
    assert files_left(before, [os.getpid(), *pids, *children.values()]) == [], iid2


SCRIPT = """
import sys
from lightserve import GenerationConfig, pipeline

if __name__ == "__main__":
    pipe = pipeline(data_type="float32", max_total_token_num=16384)
    print(pipe.config.instance_id, *[c.proc.pid for c in pipe._procs.children], flush=True)
    pipe.infer("Hi", GenerationConfig(max_new_tokens=2))
    # no close(): the atexit hook must stop the children and unlink the segment
"""


def test_interpreter_exit_without_close_cleans_up(tmp_path):
    before = lightserve_files()
    proc = _run_script(tmp_path, SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    iid, *pids = proc.stdout.split()
    assert wait_until(lambda: not [p for p in pids if _alive(int(p))], 10)
    script_pid = int(iid.split("-")[0])  # the instance id starts with its launching process's pid
    assert files_left(before, [script_pid, *map(int, pids)]) == []


def _has_segment_and_sockets(files: list[str]) -> bool:
    """The leak checks look where a live launch keeps its files: its pool segment and its ipc sockets."""
    return (any(f.endswith("-reqs") for f in files)
            and any(Path(f).parent == RUNTIME_DIRS[1] for f in files))


def test_script_without_main_guard_gets_a_clear_error(tmp_path):
    """spawn re-imports the main module in each child: pipeline() there must say what to do."""
    proc = _run_script(tmp_path, SCRIPT.replace('if __name__ == "__main__":\n', "if True:\n"))
    assert proc.returncode != 0
    assert "if __name__ == '__main__':" in proc.stderr and "StartError" in proc.stderr, proc.stderr[-3000:]
