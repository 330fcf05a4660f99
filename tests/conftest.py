"""Shared pytest setup. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here,
before anything imports lightserve.kernels: without a GPU, Triton kernels run in the interpreter.

Skips: a test that needs a GPU is marked `gpu` and skipped without one; nothing else should skip on
a CPU machine. Every run ends with a line counting the skipped tests, and on a machine without CUDA
any skip of an unmarked test fails the run (a skipped test proves nothing), `make test` and a local
pytest alike, with or without `CI` set."""
import os
import secrets

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
_skips: list = []  # TestReports and CollectReports


@pytest.fixture
def make_pool():
    """make_pool(num_slots, max_len, max_top_logprobs=5): a request pool over a fresh shared-memory segment, as the
    server creates it; each one made is closed and its segment unlinked after the test."""
    from lightserve.shm.req_pool import ReqPool  # after TRITON_INTERPRET above, as every lightserve import

    made = []

    def make(num_slots: int, max_len: int, max_top_logprobs: int = 5) -> ReqPool:
        made.append(ReqPool.create(f"lightserve-{os.getpid()}-{secrets.token_hex(4)}-test", num_slots, max_len,
                                   max_top_logprobs))
        return made[-1]

    yield make
    for pool in made:
        pool.close()
        pool.segment.unlink()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    no_gpu = pytest.mark.skip(reason="GPU-only: no CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a whole module skipped at import (pytest.importorskip, allow_module_level)
        _skips.append(report)


def _disallowed_skips() -> list:
    """Skips that fail the run: any on a machine without CUDA, except of tests marked gpu."""
    return [] if HAS_CUDA else [r for r in _skips if "gpu" not in getattr(r, "keywords", {})]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _disallowed_skips() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    gpu_only = len(_skips) - len(_disallowed_skips()) if not HAS_CUDA else 0
    terminalreporter.write_line(f"skipped tests: {len(_skips)} ({gpu_only} GPU-only)")
    for report in _disallowed_skips():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"  skipped on a CPU machine: {report.nodeid}: {reason}")
    if _disallowed_skips():
        terminalreporter.write_line("a skip on a CPU machine fails the run (mark GPU-only tests gpu)", red=True)
