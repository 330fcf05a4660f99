"""LIGHTSERVE_CPU_BUILD: which build of the CPU C kernels library() loads."""
import pytest

from lightserve.kernels.cpu import c_compiler, cpu_flags, library, variant_library


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
