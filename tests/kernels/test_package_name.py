"""The checkout's kernels/ folder imports only as `lightserve.kernels`. Run from the repo root,
`import kernels` would find it under the name of the HF Kernel Hub package, which transformers and
vLLM import: there it must hand over to that package where it is installed, and otherwise look like
no package at all."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, *flags: str, cwd: Path = REPO, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_PROBE = (
    "import sys, kernels\n"
    "loaded = any(m.startswith('lightserve.kernels') for m in sys.modules)\n"
    "print(kernels.__file__, loaded)\n"
    "for stmt in ('from kernels import get_kernel', 'import kernels.rmsnorm'):\n"
    "    try:\n"
    "        exec(stmt)\n"
    "        print('imported')\n"
    "    except ImportError:\n"
    "        print('refused')\n"
)


def test_top_level_kernels_is_an_empty_shadow_where_no_other_package_has_the_name():
    # -S: no site-packages, so no installed `kernels` either.
    assert _run(_PROBE, "-S").splitlines() == ["None False", "refused", "refused"]


def test_top_level_kernels_hands_over_to_an_installed_package_of_that_name(tmp_path):
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '9.0'\ndef get_kernel():\n    pass\n")
    (pkg / "rmsnorm.py").write_text("")
    out = _run(_PROBE, "-S", env={"PYTHONPATH": str(tmp_path)}).splitlines()
    assert out == [f"{pkg / '__init__.py'} False", "imported", "imported"]


def test_transformers_sees_the_same_kernels_package_from_the_repo_root(tmp_path):
    probe = "import transformers.activations, transformers.utils as u; print(u.is_kernels_available())"
    assert _run(probe) == _run(probe, cwd=tmp_path)


def test_lightserve_kernels_imports():
    assert _run("import lightserve.kernels as k; print(callable(k.rmsnorm), k.__file__.endswith('__init__.py'))") \
        == "True True"
