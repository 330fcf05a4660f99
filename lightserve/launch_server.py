"""`python -m lightserve.launch_server` / `lightserve-launch`: start every process, then serve HTTP.

The launcher process runs the HTTP front itself (FastAPI on uvicorn with uvloop) and watches its
children: if one dies, /health turns 503 at once, in-flight requests end with an error, and the
launcher stops everything and exits non-zero. Ctrl-C or SIGTERM drains (lightserve/http/drain.py: new
requests 503, in-flight ones run on for up to --shutdown_grace_s, the rest are aborted visibly; a
second signal aborts at once), then stops all processes, removes every shared-memory segment of
this launch and exits 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Sequence

from lightserve.cli import parse_args
from lightserve.config import ServerConfig
from lightserve.log import configure_logging, get_logger

logger = get_logger("lightserve.launcher")

EXIT_CHILD_DIED = 3
EXIT_START_FAILED = 2
FAULT_STOP_GRACE_S = 1.0  # SIGTERM-to-SIGKILL grace for the other children once one has died
REAP_TIMEOUT_S = 1.0
# A non-zero node gives up on node 0 after this many failed probes, one every NODE0_PROBE_S.
NODE0_PROBE_S = 2.0
NODE0_PROBE_FAILURES = 3


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging("launcher", config.log_level)
    # SIGTERM during start-up must still run the cleanup (children, shm); uvicorn installs its
    # own handlers once it serves.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    code = serve(config)
    # NOTE: as in the children (procutil.child_process), skip interpreter finalization: every
    # process and file of this launch is gone by now, and tearing down torch/transformers state
    # took 8 s on a loaded machine, enough to break the 10 s bound on stopping after a crash.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _raise_interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def serve(config: ServerConfig) -> int:
    from lightserve.engine.procs import EngineProcs, StartError
    from lightserve.resolve_config import resolve_config

    t0 = time.monotonic()
    procs = None
    try:
        config = resolve_config(config)
        logger.info("model %s (%s), device %s, dtype %s, tp %d", config.model_dir, config.model.architecture,
                    config.device.value, config.data_type.value, config.tp)
        procs = EngineProcs(config)
        # The front's own slow part (transformers import, tokenizer load) overlaps the engine start.
        front_prep = _FrontPrep(config) if config.is_master_node else None
        config = procs.start()
    except StartError as exc:
        logger.error("start-up failed: %s", exc)
        return EXIT_START_FAILED
    except KeyboardInterrupt:
        if procs is not None:
            procs.stop()
        return 130
    code = 0
    try:
        code = _serve_http(config, front_prep, procs, t0) if config.is_master_node else _serve_worker_node(procs)
        return code
    except KeyboardInterrupt:  # a signal before uvicorn took over the handlers
        return 0
    finally:
        # The stop below is bounded (a join, then SIGKILL); a signal now would only interrupt it
        # half-way and leave children or shared memory behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        # After a child died the engine is broken and nothing is worth waiting for: a short grace
        # keeps the whole stop within 10 s even when a worker is in a long step.
        if code == EXIT_CHILD_DIED:
            procs.stop(grace_s=FAULT_STOP_GRACE_S)
        else:
            procs.stop()
        logger.info("stopped")


def _serve_worker_node(procs) -> int:
    """Nodes other than 0 run only worker ranks: wait until one exits, node 0 goes away, or we are
    told to stop.

    Node 0's liveness is its rank 0's rendezvous store on --nccl_host:--nccl_port, which lives as long
    as the TP group does. An idle rank here only waits on a zmq socket (which reconnects forever), so
    without this probe a dead node 0 would leave this node running until the next collective.
    """
    config = procs.config
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    failures = 0
    next_probe = time.monotonic() + NODE0_PROBE_S
    while not stop.is_set():
        dead = procs.watch(timeout=0.5)
        if dead is not None:
            dead.proc.join(REAP_TIMEOUT_S)
            logger.error("%s (pid %d) exited with code %s; stopping this node", dead.name, dead.proc.pid,
                         dead.proc.exitcode)
            return EXIT_CHILD_DIED
        if time.monotonic() < next_probe:
            continue
        next_probe = time.monotonic() + NODE0_PROBE_S
        failures = 0 if _reachable(config.nccl_host, config.nccl_port) else failures + 1
        if failures >= NODE0_PROBE_FAILURES:
            logger.error("node 0 (rank 0's store at %s:%d) unreachable for %d probes; stopping this node",
                         config.nccl_host, config.nccl_port, failures)
            return EXIT_CHILD_DIED
    return 0


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=NODE0_PROBE_S):
            return True
    except OSError:
        return False


class _FrontPrep:
    """Imports the HTTP front and loads its tokenizer on a thread, while the engine processes start
    (the launcher's main thread only waits for them then)."""

    def __init__(self, config: ServerConfig):
        self._result: tuple | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="front-prep", daemon=True)
        self._thread.start()

    def _run(self, config: ServerConfig) -> None:
        try:
            import uvicorn  # noqa: F401 - imported for its cost, here

            import lightserve.http.app  # noqa: F401
            from lightserve.hf_tokenizer import load_tokenizer
            from lightserve.sampling import generation_defaults

            model_dir = config.model_dir

            tokenizer = load_tokenizer(model_dir)
            if config.chat_template is not None:
                with open(config.chat_template) as f:
                    tokenizer.chat_template = f.read()
            source = {"auto": model_dir, "vllm": None}.get(config.generation_config, config.generation_config)
            defaults = generation_defaults(source) if source is not None else {}
            if defaults:
                logger.info("default sampling params from %s/generation_config.json: %s", source, defaults)
            self._result = (tokenizer, config.vocab_size, defaults)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by get()
            self._error = exc

    def get(self) -> tuple:
        """(tokenizer, vocab_size, sampling defaults)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def _serve_http(config: ServerConfig, front_prep: _FrontPrep, procs, t0: float) -> int:
    import uvicorn

    from lightserve.engine.client import EngineClient
    from lightserve.http.app import create_app
    from lightserve.http.drain import DrainingServer

    tokenizer, vocab_size, sampling_defaults = front_prep.get()
    engine = EngineClient(config, procs.pool, config.max_req_total_len, vocab_size)
    dead: dict[str, str] = {}

    def health() -> str | None:
        if dead:
            return dead["reason"]
        child = procs.dead_child()
        return None if child is None else f"{child.name} is not running"

    app = create_app(config, engine, tokenizer, config.served_model_name[0], health, procs.model_dir,
                     sampling_defaults)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, loop="uvloop",
                                           log_level=config.log_level.lower(), timeout_graceful_shutdown=3,
                                           access_log=False), app.state.front.drain)

    def watch_children() -> None:
        while not server.should_exit:
            child = procs.watch(timeout=0.5)
            if child is None or server.should_exit:
                continue
            child.proc.join(REAP_TIMEOUT_S)  # for its exit code
            reason = f"{child.name} (pid {child.proc.pid}) exited with code {child.proc.exitcode}"
            logger.error("%s; stopping the server", reason)
            dead["reason"] = reason
            engine.mark_dead_threadsafe(reason)
            time.sleep(0.5)  # let in-flight requests receive their errors
            server.should_exit = True
            return

    logger.info("engine ready in %.1f s; serving on http://%s:%d", time.monotonic() - t0, config.host, config.port)
    threading.Thread(target=watch_children, name="child-watch", daemon=True).start()
    server.run()
    return EXIT_CHILD_DIED if dead else 0


if __name__ == "__main__":
    main()
