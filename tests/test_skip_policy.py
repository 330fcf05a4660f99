"""tests/conftest.py's skip policy, on a scratch test module run by an inner pytest: on a machine
without CUDA a skip of an unmarked test (a missing package, no compiler) fails the run whether or not
`CI` is set, as `make test` runs it; a skip of a test marked gpu does not."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SCRATCH_TESTS = '''
import pytest


def test_runs():
    pass


@pytest.mark.gpu
def test_needs_a_gpu():
    pass


def test_needs_a_missing_package():
    pytest.importorskip("lightserve_no_such_package")
'''


def test_a_skip_on_a_cpu_machine_fails_the_run_without_ci(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    (tmp_path / "test_scratch.py").write_text(SCRATCH_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    if torch.cuda.is_available():  # there every test may skip
        assert run.returncode == 0, out
        return
    assert run.returncode == 1 and "1 passed, 2 skipped" in out, out
    assert "skipped tests: 2 (1 GPU-only)" in out, out
    # Only the unmarked skip is blamed.
    assert [line.split(": ")[1] for line in out.splitlines() if "skipped on a CPU machine:" in line] == [
        "test_scratch.py::test_needs_a_missing_package"], out
