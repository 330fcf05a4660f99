"""What every child process does at start: logging, the ready-or-error handshake with the launcher,
exiting when the launcher dies, and turning SIGTERM/SIGINT into a clean stop.

Each process entry looks like:

    def run_router(config: ServerConfig, ready: Connection) -> None:
        with child_process("router", config, ready) as stop:
            ... open sockets, attach shm ...
            report_ready(ready)
            while not stop.is_set(): ...
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterator

from lightserve.config import SHM_PREFIX, ServerConfig
from lightserve.log import configure_logging, get_logger

logger = get_logger(__name__)

PARENT_POLL_S = 0.5
# How long an orphaned child's body gets to stop on its own before the parent watch ends the
# process itself (a blocked send or a long forward must not leave it running with nobody to stop it).
ORPHAN_GRACE_S = 5.0


@contextlib.contextmanager
def child_process(name: str, config: ServerConfig, ready: Connection) -> Iterator[threading.Event]:
    """Set up a child; yield an Event that is set when the process should stop.

    An exception escaping the body is logged, sent to the launcher (which shows the traceback if
    the child had not reported ready yet) and ends the process with exit code 1.
    """
    configure_logging(name, config.log_level)
    stop = threading.Event()
    parent = os.getppid()

    def on_signal(signum, _frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C reaches the whole process group; the launcher coordinates the stop, so children
    # ignore SIGINT and wait for the launcher's SIGTERM (or its death).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    orphaned = threading.Event()

    def watch_parent() -> None:
        # Exit on our own if the launcher dies (kill -9 included): its pid stops being our parent.
        while not stop.wait(PARENT_POLL_S):
            if os.getppid() != parent:
                logger.error("launcher (pid %d) is gone; exiting", parent)
                orphaned.set()
                stop.set()
                time.sleep(ORPHAN_GRACE_S)
                # Still here: the body is stuck. Leave its stacks in the log, then exit without it.
                logger.error("%s did not stop within %.0f s of its launcher's death; forcing exit", name,
                             ORPHAN_GRACE_S)
                with contextlib.suppress(Exception):
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                remove_instance_files(config)
                logging.shutdown()
                os._exit(1)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    code = 0
    try:
        yield stop
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then the process exits 1
        if not (isinstance(exc, (KeyboardInterrupt, SystemExit)) and stop.is_set()):
            code = 1
            logger.error("%s failed: %s", name, exc, exc_info=True)
            with contextlib.suppress(Exception):
                ready.send(("error", f"{name}: {exc!r}\n{traceback.format_exc()}"))
    finally:
        if orphaned.is_set():
            # Nobody is left to unlink this launch's segments and socket files: every orphan tries
            # (unlink is idempotent), so none outlives the last child.
            remove_instance_files(config)
        # NOTE: the body has closed its sockets and segments. Skip interpreter finalization: tearing
        # down torch/transformers module state takes seconds on a busy machine (a garbage
        # collection over millions of objects) and would make every stop slow.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def remove_instance_files(config: ServerConfig) -> None:
    for directory in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        for path in directory.glob(f"{SHM_PREFIX}{config.instance_id}-*"):
            path.unlink(missing_ok=True)


def report_ready(ready: Connection, info: dict | None = None) -> None:
    ready.send(("ready", info or {}))
