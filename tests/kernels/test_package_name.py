"""The checkout's kernels/ folder imports only as `lightserve.kernels`. Run from the repo root,
`import kernels` would find it under the name of the HF Kernel Hub package, which transformers and
vLLM probe for; there it must look like no package at all."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_top_level_kernels_is_an_empty_shadow_from_the_repo_root():
    out = _run(
        "import sys, kernels\n"
        "loaded = any(m.startswith('lightserve.kernels') for m in sys.modules)\n"
        "print(kernels.__file__, list(kernels.__path__), loaded)\n"
        "for stmt in ('from kernels import get_kernel', 'import kernels.rmsnorm'):\n"
        "    try:\n"
        "        exec(stmt)\n"
        "    except ImportError:\n"
        "        print('refused')\n"
    )
    assert out.splitlines() == ["None [] False", "refused", "refused"]


def test_transformers_sees_no_kernels_package_from_the_repo_root():
    assert _run("import transformers; print(transformers.utils.is_kernels_available())") == "False"


def test_lightserve_kernels_imports():
    assert _run("import lightserve.kernels as k; print(callable(k.rmsnorm), k.__file__.endswith('__init__.py'))") \
        == "True True"
