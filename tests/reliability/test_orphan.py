"""A child whose launcher dies (kill -9) exits on its own: at once when its body heeds the stop
event, and after procutil.ORPHAN_GRACE_S when the body is stuck, leaving the stuck stacks in the
log. Either way it removes the launch's shared-memory and socket files, since no launcher is left
to do it. The launcher here is a small script that starts one child through child_process, as the
real launcher starts the router, detokenizer and workers."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightserve.procutil import ORPHAN_GRACE_S
from tests.e2e.server import wait_until
from tests.reliability.helpers import alive

LAUNCHER = textwrap.dedent("""
    import multiprocessing, sys
    from lightserve.config import ServerConfig
    from tests.reliability.test_orphan import child

    config = ServerConfig()
    ctx = multiprocessing.get_context("spawn")
    theirs, ours = ctx.Pipe()
    proc = ctx.Process(target=child, args=(config, theirs, sys.argv[1], sys.argv[2]))
    proc.start()
    assert ours.recv()[0] == "ready"
    print(proc.pid, flush=True)
    proc.join()
""")


def child(config, ready, body: str, marker: str) -> None:
    """The child's entry: a launch file to clean up, then a body that heeds `stop` or ignores it."""
    from lightserve.procutil import child_process, report_ready

    with child_process("orphan-test", config, ready) as stop:
        Path(marker).write_text(f"/dev/shm/lightserve-{config.instance_id}-segment")
        Path(f"/dev/shm/lightserve-{config.instance_id}-segment").write_bytes(b"x")
        report_ready(ready)
        if body == "heeds":
            stop.wait()
        else:
            stuck_forever()


def stuck_forever() -> None:
    while True:  # a blocked call that never looks at the stop event
        time.sleep(0.1)


@pytest.mark.parametrize("body", ["heeds", "stuck"])
def test_orphaned_child_exits_and_removes_launch_files(tmp_path, body):
    marker, log = tmp_path / "segment", tmp_path / "launcher.log"
    with open(log, "wb") as out:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, body, str(marker)], stdout=subprocess.PIPE,
                                    stderr=out, cwd=Path(__file__).parents[2], start_new_session=True)
    segment = None
    try:
        line = launcher.stdout.readline()
        assert line, log.read_text()
        pid, segment = int(line), Path(marker.read_text())
        assert alive(pid) and segment.exists()
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        t_kill = time.monotonic()
        assert wait_until(lambda: not alive(pid), ORPHAN_GRACE_S + 15), log.read_text()
        took = time.monotonic() - t_kill
        text = log.read_text()
        assert "is gone; exiting" in text, text
        assert not segment.exists()
        if body == "stuck":
            # The forced exit came after the grace, and the log shows where the body was stuck.
            assert took >= ORPHAN_GRACE_S - 1, took
            assert "forcing exit" in text and "stuck_forever" in text, text
        else:
            assert "forcing exit" not in text, text
    finally:  # a failed run leaves nothing either (the child is in the launcher's process group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        if segment is not None:
            segment.unlink(missing_ok=True)
