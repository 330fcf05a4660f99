"""LIGHTSERVE_CPU_BUILD: which build of the CPU C kernels library() loads; kernels.h as the one declaration of the
library's entry points."""
import ctypes
import re
from pathlib import Path

import pytest

from lightserve.kernels import cpu
from lightserve.kernels.cpu import c_compiler, c_signatures, cpu_flags, library, variant_library


@pytest.fixture
def fresh_library():
    """library() is cached per process: clear it around the test, so the others load the native build again."""
    library.cache_clear()
    yield library
    library.cache_clear()


def test_a_narrower_build_is_loaded_on_request(monkeypatch, fresh_library):
    if c_compiler() is None or "avx2" not in cpu_flags().split():
        pytest.skip("needs a C compiler and an AVX2 CPU")
    native = fresh_library()
    fresh_library.cache_clear()
    monkeypatch.setenv("LIGHTSERVE_CPU_BUILD", "avx2")
    lib = fresh_library()
    assert lib._name == variant_library("avx2")._name
    assert lib.linear_panel_width() == 16 and not lib.linear_bf16_pairs_dpbf16()  # 8-float vectors, no vdpbf16ps
    assert lib._name != native._name  # the flags are in the build's cache key, so even on an AVX2 CPU it is another


def test_an_unknown_build_is_an_error(monkeypatch, fresh_library):
    monkeypatch.setenv("LIGHTSERVE_CPU_BUILD", "avx9")
    with pytest.raises(ValueError, match="'avx9': not one of native, avx512, avx2, portable"):
        fresh_library()


def test_kernels_h_declares_every_entry_point_and_load_takes_its_signatures():
    """Every function a source defines without `static` is declared in kernels.h (the compiler checks the two agree),
    and load() gives each the ctypes signature read from there: no entry point is called with ctypes' default int
    arguments."""
    defined = set()
    for path in Path(cpu.__file__).parent.glob("*.c"):
        defined |= set(re.findall(r"^(?:int|void|int64_t|float|double)\s+\**(\w+)\s*\(", path.read_text(), flags=re.M))
    signatures = c_signatures()
    assert defined == set(signatures)
    assert signatures["decode_attention_supported"] == (ctypes.c_int, [ctypes.c_int] * 3)
    assert signatures["rmsnorm"][0] is None and signatures["rmsnorm"][1][6] is ctypes.c_float
    assert signatures["struct_layout"] == (ctypes.c_int64, [ctypes.c_char_p])
    lib = library()
    if lib is None:
        pytest.skip("no C compiler here")
    for name, (restype, argtypes) in signatures.items():
        assert getattr(lib, name).restype is restype and getattr(lib, name).argtypes == argtypes, name
