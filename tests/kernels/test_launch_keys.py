"""record_launches: one key per distinct Triton specialization (pointer alignment and dtype, int divisibility and
value 1 unless do_not_specialize, constexpr values, num_warps / num_stages), nested blocks, and the launch entry
point restored on exit."""
import torch
import triton
import triton.language as tl

from lightserve.kernels.launch_keys import record_launches
from tests.kernels.kernel_cases import DEVICE


@triton.jit(do_not_specialize=["count"])
def _copy_kernel(src_ptr, dst_ptr, n, count, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * scale + count * 0, mask=mask)


def _launch(src, n, count=5, block=16, num_warps=4):
    dst = torch.empty(n, dtype=src.dtype, device=DEVICE)
    _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, count, 0.5, BLOCK=block, num_warps=num_warps)
    return dst


def _spec(key):
    name, spec = key
    assert name == "_copy_kernel"
    return {entry[0]: entry[1:] for entry in spec}


def test_keys_follow_what_triton_specializes_on():
    base = torch.arange(64, dtype=torch.float32, device=DEVICE)
    with record_launches() as log:
        out = _launch(base, 32)
        _launch(base, 48)                     # another multiple of 16: the same key
        _launch(base, 32, count=17)           # do_not_specialize: the same key
        _launch(base, 32, count=2**31)        # ... but a value past int32 has another type
        _launch(base[1:], 32)                 # src 4 bytes past a 16-byte boundary
        _launch(base, 33)                     # n not a multiple of 16
        _launch(base, 1)                      # n == 1 is a constant
        _launch(base, 32, block=32)           # another constexpr
        _launch(base, 32, num_warps=2)        # another launch option
        _launch(base.half(), 32)              # another dtype
    assert torch.equal(out, base[:32] * 0.5)  # the launches ran
    assert log.num_launches == 10 and log.kernels() == {"_copy_kernel"}
    specs = [_spec(k) for k in log.keys]
    assert len(specs) == 8  # 10 launches, 3 of them the first one's key
    assert all(s["scale"] == ("fp32", None) and s["num_stages"] == (None,) for s in specs)  # floats: type only
    seen = {(s["src_ptr"], s["n"], s["count"], s["BLOCK"], s["num_warps"]) for s in specs}
    aligned, i32 = ("tensor", "torch.float32", True), ("i32", None)
    assert (("tensor", "torch.float32", False), ("i32", True), i32, ("constexpr", 16), (4,)) in seen
    assert (aligned, ("i32", False), i32, ("constexpr", 16), (4,)) in seen
    assert (aligned, ("constexpr", 1), i32, ("constexpr", 16), (4,)) in seen
    assert (aligned, ("i32", True), ("u32", None), ("constexpr", 16), (4,)) in seen
    assert (aligned, ("i32", True), i32, ("constexpr", 32), (4,)) in seen
    assert (aligned, ("i32", True), i32, ("constexpr", 16), (2,)) in seen
    assert (("tensor", "torch.float16", True), ("i32", True), i32, ("constexpr", 16), (4,)) in seen


def test_blocks_nest_and_the_entry_point_is_restored():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    before = (JITFunction.run, InterpretedFunction.run)
    src = torch.ones(16, device=DEVICE)
    with record_launches() as outer:
        _launch(src, 16)
        with record_launches() as inner:
            _launch(src, 17)
        _launch(src, 1)
    assert (JITFunction.run, InterpretedFunction.run) == before
    assert len(inner.keys) == 1 and len(outer.keys) == 3 and inner.keys < outer.keys
    with record_launches() as after:
        pass
    _launch(src, 16)  # outside any block: recorded nowhere
    assert not after.keys and outer.num_launches == 3
