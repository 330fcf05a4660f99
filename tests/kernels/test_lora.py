"""lora: the C kernels (lora.c: lora_shrink, lora_expand, and lora_apply fusing them) against the reference in every
build this CPU runs, over float32 and bf16 activations, segment patterns (base-model tokens between segments, one token,
one long segment of several work chunks, many short segments, a slot in two separate runs), ranks 8/16/64 with 1, 2
and 3 slices of uneven widths (N and K not multiples of the vector width, columns no slice writes) and strided x and
y; what is outside every segment and slice stays bit for bit untouched; the same over bf16 stacks (--lora_dtype),
which every kernel widens to float32, so the reference widens them too. The Triton kernels in the interpreter (or on
the GPU) on a few small cases, bf16 and fp16 stacks among them; the dispatch (fp16 stacks on CPU: the reference); bad
segments and slices refused; LoraSegments.from_token_slots.

Tolerance: the kernels sum float32 products in another order than the reference's GEMM, so each output may differ
by 1e-5 of the sum of its terms' magnitudes (|y| + |x| |A| |BT|, computed by the reference on absolute values in
float64), and a bf16 output by one bf16 rounding step (2^-7 of its value) more."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.kernels import cpu as cpu_kernels
from lightserve.kernels.cpu import kernel_times, library, variant_library
from lightserve.kernels.lora import (
    LoraSegments,
    lora_apply,
    lora_apply_cpu,
    lora_apply_ref,
    lora_expand,
    lora_expand_cpu,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink,
    lora_shrink_cpu,
    lora_shrink_ref,
    lora_shrink_triton,
)
from tests.kernels.kernel_cases import DEVICE, c_library_variants

needs_c = pytest.mark.skipif(library() is None, reason="no C compiler: lora runs the reference")
NUM_SLOTS = 5

# Each token's slot (-1: the base model).
PATTERNS = {
    "interleaved": [-1, 0, 0, 1, 1, 1, -1, 2, 2, 2, 2, 2, 2, 0, 0, -1, 4],  # slot 0 in two runs
    "one_token": [3],
    "long": [1] * 75,  # 5 shrink chunks of 16 tokens, 2 expand chunks of 64
    "many_short": [0, 1, 2, 3] * 6 + [-1, -1],
    "decode_batch": list(np.repeat(np.arange(8) % NUM_SLOTS, 5)),  # 8 segments of 5 tokens, slots repeating
}
# (K, R, N, slices): (r0, rj, n0, nj) each. N and K off the vector widths; columns past the last slice, and a gap
# between slices, that no slice writes.
SHAPES = {
    "r8_one": (100, 8, 37, ((0, 8, 0, 37),)),
    "r16_two": (64, 16, 160, ((0, 8, 0, 45), (8, 8, 50, 100))),
    "r64_qkv": (300, 64, 149, ((0, 32, 0, 96), (32, 16, 96, 33), (48, 16, 129, 17))),
}


def segments(slots) -> LoraSegments:
    segs = LoraSegments.from_token_slots(np.array(slots, dtype=np.int32))
    assert segs is not None
    return segs


def make_case(num_tokens: int, shape: str, dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu",
              wdtype: torch.dtype = torch.float32):
    """x [T, K] and y [T, N] as strided views (rows wider than the tensor, starting off vector alignment), a and bt
    of NUM_SLOTS slots in wdtype."""
    k, r, n, slices = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k + 7, generator=g).to(dtype)[:, 3:3 + k]
    a = (torch.randn(NUM_SLOTS, r, k, generator=g) / k ** 0.5).to(wdtype)
    bt = torch.randn(NUM_SLOTS, r, n, generator=g).to(wdtype)
    y = (torch.randn(num_tokens, n + 5, generator=g) * 4).to(dtype)[:, 1:1 + n]
    return *(t.to(device) for t in (x, a, bt, y)), slices


def magnitudes(y, x, a, bt, segs, slices) -> torch.Tensor:
    """Each output's |y| + sum of |x| |A| |BT| terms, in float64 (|y| alone where the LoRA adds nothing)."""
    mag = y.abs().double()
    for s0, n, slot in zip(segs.host_starts.tolist(), segs.host_lens.tolist(), segs.host_slots.tolist()):
        xa = x[s0:s0 + n].abs().double() @ a[slot].abs().double().T  # [n, R]
        for r0, rj, n0, nj in slices:
            mag[s0:s0 + n, n0:n0 + nj] += xa[:, r0:r0 + rj] @ bt[slot, r0:r0 + rj, n0:n0 + nj].abs().double()
    return mag


def assert_within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> None:
    tol = 1e-5 * mag + 1e-30
    if got.dtype in (torch.bfloat16, torch.float16):
        tol = tol + want.double().abs() * 2.0 ** -7
    err = (got.double() - want.double()).abs()
    assert bool((err <= tol).all()), f"max error over tolerance {float((err / tol).max()):.3g} at " \
                                     f"{np.unravel_index(int((err / tol).argmax()), err.shape)}"


def touched(segs: LoraSegments, slices, shape) -> torch.Tensor:
    """[T, N] bool: the outputs the LoRA writes."""
    rows, cols = torch.zeros(shape[0], dtype=torch.bool), torch.zeros(shape[1], dtype=torch.bool)
    for s0, n in zip(segs.host_starts.tolist(), segs.host_lens.tolist()):
        rows[s0:s0 + n] = True
    for _, rj, n0, nj in slices:
        cols[n0:n0 + nj] = rj > 0
    return rows[:, None] & cols[None, :]


def assert_updated_like_reference(got, y0, want, mag, segs, slices):
    """got matches want where the LoRA writes (which the reference does change), and equals y0 bit for bit
    elsewhere."""
    mask = touched(segs, slices, y0.shape).to(got.device)
    assert torch.equal(got[~mask], y0[~mask])
    assert bool((want[mask] != y0[mask]).any())
    assert_within(got, want, mag)


def check_c_kernels(lib, segs, x, a, bt, y0, slices):
    """lora_shrink_cpu, lora_expand_cpu and lora_apply_cpu of `lib` against the reference, over strided xa and y."""
    dtype = x.dtype
    xa = lora_shrink_cpu(x, a, segs, lib=lib)
    want_xa = lora_shrink_ref(x, a, segs)
    assert xa is not None and xa.shape == want_xa.shape and xa.dtype == torch.float32
    in_segs = touched(segs, ((0, 1, 0, 1),), (x.shape[0], 1))[:, 0]
    assert torch.equal(xa[~in_segs], torch.zeros_like(xa[~in_segs]))
    assert_within(xa, want_xa, (x.abs().double() @ a.abs().double().transpose(1, 2)).amax(0))

    xa_rows = torch.full((x.shape[0], a.shape[1] + 3), float("nan"))  # xa as a strided view
    xa_rows[:, 1:-2] = want_xa
    y = y0.clone()
    assert lora_expand_cpu(y, xa_rows[:, 1:-2], bt, segs, slices, lib=lib) is y
    want = lora_expand_ref(y0.clone(), want_xa, bt, segs, slices)
    mag = magnitudes(y0, x, a, bt, segs, slices)
    assert_updated_like_reference(y, y0, want, mag, segs, slices)

    # The fused call, into a strided y (a view of a wider buffer, whose other columns must stay as they are).
    wide = torch.zeros(y0.shape[0], y0.shape[1] + 9, dtype=dtype)
    wide[:, 4:4 + y0.shape[1]] = y0
    y = wide[:, 4:4 + y0.shape[1]]
    assert lora_apply_cpu(y, x, a, bt, segs, slices, lib=lib) is y
    assert torch.equal(wide[:, :4], torch.zeros(y.shape[0], 4, dtype=dtype)) and not wide[:, -5:].any()
    assert_updated_like_reference(y, y0, lora_apply_ref(y0.clone(), x, a, bt, segs, slices), mag, segs, slices)


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernels_match_reference(variant, dtype, pattern, shape):
    segs = segments(PATTERNS[pattern])
    check_c_kernels(variant_library(variant), segs,
                    *make_case(len(PATTERNS[pattern]), shape, dtype, seed=len(pattern) + len(shape)))


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_c_kernels_read_bf16_stacks(variant, dtype):
    """bf16 A and BT (--lora_dtype bfloat16), widened as loaded: the shrink's rows, the expand's rows packed (segments
    of 4 tokens or more) and read in place (fewer), the vector and scalar column tails; against the reference on the
    same bf16 stacks, within the float32 tolerance."""
    lib = variant_library(variant)
    for pattern in ("interleaved", "long", "one_token"):
        for shape in SHAPES:
            x, a, bt, y0, slices = make_case(len(PATTERNS[pattern]), shape, dtype, seed=len(pattern) + len(shape),
                                             wdtype=torch.bfloat16)
            check_c_kernels(lib, segments(PATTERNS[pattern]), x, a, bt, y0, slices)


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
def test_c_kernels_over_parallel_work_and_model_shapes(variant):
    """Large enough to run on every thread (LORA_PAR_MIN): a prefill segment beside decode tokens, SmolLM2's q/k/v
    shapes (K 576, rank 16, slices 576/192/192) in bf16, every rank-block and column-block boundary."""
    lib = variant_library(variant)
    slots = [0] * 130 + [-1] * 3 + [1, 2, 2, 3]
    segs = segments(slots)
    g = torch.Generator().manual_seed(7)
    k, r, n = 576, 16, 960
    slices = ((0, 16, 0, 576), (0, 16, 576, 192), (0, 16, 768, 192))
    x = torch.randn(len(slots), k, generator=g).bfloat16()
    a, bt = torch.randn(4, r, k, generator=g) * 0.05, torch.randn(4, r, n, generator=g) * 0.05
    y0 = torch.randn(len(slots), n, generator=g).bfloat16()
    old = torch.get_num_threads()
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            y = lora_apply_cpu(y0.clone(), x, a, bt, segs, slices, lib=lib)
        finally:
            torch.set_num_threads(old)
        assert_updated_like_reference(y, y0, lora_apply_ref(y0.clone(), x, a, bt, segs, slices),
                                      magnitudes(y0, x, a, bt, segs, slices), segs, slices)


@needs_c
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["f32_stacks", "bf16_stacks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_c_kernels_round_like_the_reference_where_sums_are_exact(variant, dtype, wdtype):
    """Small integers everywhere: every sum is exact in float32 in any order, so the kernels must give the reference's
    bits, bf16 roundings included (y + delta of 9 to 11 significant bits: ties rounded to even); bf16 stacks widen to
    the same float32 values."""
    lib = variant_library(variant)
    segs = segments(PATTERNS["interleaved"])
    k, r, n, slices = SHAPES["r64_qkv"]
    g = torch.Generator().manual_seed(2)
    t = len(PATTERNS["interleaved"])
    x = torch.randint(-3, 4, (t, k), generator=g).to(dtype)
    a = torch.randint(-2, 3, (NUM_SLOTS, r, k), generator=g).to(wdtype)
    bt = torch.randint(-2, 3, (NUM_SLOTS, r, n), generator=g).to(wdtype)
    y0 = torch.randint(-600, 601, (t, n), generator=g).to(dtype)
    want = lora_apply_ref(y0.clone(), x, a, bt, segs, slices)
    assert torch.equal(lora_apply_cpu(y0.clone(), x, a, bt, segs, slices, lib=lib), want)
    xa = lora_shrink_cpu(x, a, segs, lib=lib)
    assert torch.equal(xa, lora_shrink_ref(x, a, segs))
    assert torch.equal(lora_expand_cpu(y0.clone(), xa, bt, segs, slices, lib=lib), want)


@needs_c
def test_no_segment_leaves_y_unchanged():
    empty = np.zeros(0, dtype=np.int32)
    segs = LoraSegments(*(torch.from_numpy(empty) for _ in range(3)), empty, empty, empty)
    x, a, bt, y0, slices = make_case(6, "r16_two", torch.float32)
    for y in (lora_apply(y0.clone(), x, a, bt, segs, slices), lora_apply(y0.clone(), x, a, bt, None, slices),
              lora_apply_cpu(y0.clone(), x, a, bt, segs, slices),
              lora_expand(y0.clone(), torch.ones(6, 16), bt, segs, slices),
              lora_expand_cpu(y0.clone(), torch.ones(6, 16), bt, segs, slices)):
        assert torch.equal(y, y0)
    assert torch.equal(lora_shrink_cpu(x, a, segs), torch.zeros(6, 16))
    assert LoraSegments.from_token_slots(np.full(6, -1, dtype=np.int32)) is None


@needs_c
def test_c_kernels_refuse_segments_and_slices_out_of_range():
    """A slot past the stacked adapters, a segment past the tokens, out-of-order segments, slices past R or N, and
    slices writing the same columns: ValueError, y untouched."""
    x, a, bt, y0, slices = make_case(6, "r16_two", torch.float32)

    def segs_of(starts, lens, slots):
        arrays = [np.array(v, dtype=np.int32) for v in (starts, lens, slots)]
        return LoraSegments(*(torch.from_numpy(v) for v in arrays), *arrays)

    bad_segs = [segs_of([0], [2], [NUM_SLOTS]), segs_of([0], [2], [-1]), segs_of([4], [3], [0]),
                segs_of([3, 0], [2, 2], [0, 1]), segs_of([0, 1], [2, 2], [0, 1])]
    for segs in bad_segs:
        y = y0.clone()
        with pytest.raises(ValueError, match="out of range"):
            lora_apply(y, x, a, bt, segs, slices)
        with pytest.raises(ValueError):
            lora_shrink_cpu(x, a, segs)
        with pytest.raises(ValueError):
            lora_expand_cpu(y, torch.ones(6, 16), bt, segs, slices)
        assert torch.equal(y, y0)
    good = segs_of([1], [3], [2])
    for bad in (((0, 17, 0, 10),), ((8, 8, 150, 11),), ((0, 8, 0, 50), (8, 8, 49, 10)), ((-1, 4, 0, 4),)):
        y = y0.clone()
        with pytest.raises(ValueError):
            lora_apply(y, x, a, bt, good, bad)
        assert torch.equal(y, y0)


def test_dispatch_runs_c_on_cpu_and_the_reference_without_it(monkeypatch):
    """lora_apply / lora_shrink / lora_expand on CPU tensors call lora.c (its label shows in kernel_times) where it
    is built, the reference where it is not or for another dtype (float16 activations or stacks), with the same
    results."""
    segs = segments(PATTERNS["interleaved"])
    x, a, bt, y0, slices = make_case(len(PATTERNS["interleaved"]), "r64_qkv", torch.float32)
    mag = magnitudes(y0, x, a, bt, segs, slices)
    want = lora_apply_ref(y0.clone(), x, a, bt, segs, slices)
    with kernel_times() as times:
        y = lora_apply(y0.clone(), x, a, bt, segs, slices)
        xa = lora_shrink(x, a, segs)
        y2 = lora_expand(y0.clone(), xa, bt, segs, slices)
    assert ("lora_cpu" in times) == (library() is not None)
    assert_updated_like_reference(y, y0, want, mag, segs, slices)
    assert_updated_like_reference(y2, y0, want, mag, segs, slices)
    half = y0.half()
    assert torch.equal(lora_apply(half.clone(), x.half(), a, bt, segs, slices, backend=KernelBackend.CPU),
                       lora_apply_ref(half.clone(), x.half(), a, bt, segs, slices))
    assert lora_apply_cpu(y0.clone(), x, a.half(), bt.half(), segs, slices) is None
    assert lora_shrink_cpu(x, a.half(), segs) is None
    assert torch.equal(lora_apply(y0.clone(), x, a.half(), bt.half(), segs, slices, backend=KernelBackend.CPU),
                       lora_apply_ref(y0.clone(), x, a.half(), bt.half(), segs, slices))
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    assert lora_apply_cpu(y0.clone(), x, a, bt, segs, slices) is None
    assert torch.equal(lora_apply(y0.clone(), x, a, bt, segs, slices), want)
    assert torch.equal(lora_shrink(x, a, segs), lora_shrink_ref(x, a, segs))


# (token slots, shape, dtype, stacks' dtype): the interpreter runs every program in numpy, so a few small cases. bf16
# is fine here: the kernels widen their operands to float32 before tl.dot.
TRITON_CASES = [
    ([-1, 0, 0, 1, 1, 1, -1, 2, 2, 2, 0, -1], "r16_two", torch.float32, torch.float32),
    ([3] * 20, "r8_one", torch.float16, torch.float32),  # two token blocks of one segment
    ([1], "r64_qkv", torch.bfloat16, torch.float32),  # one token, three slices
    ([-1, 0, 0, 2, 2, 2], "r16_two", torch.float32, torch.bfloat16),
    ([4, 4, -1, 1], "r8_one", torch.float16, torch.float16),
]


@pytest.mark.parametrize("slots, shape, dtype, wdtype", TRITON_CASES,
                         ids=["interleaved", "two_blocks", "one_token", "bf16_stacks", "fp16_stacks"])
def test_triton_kernels_match_reference(slots, shape, dtype, wdtype):
    segs = segments(slots)
    segs = LoraSegments(*(t.to(DEVICE) for t in (segs.starts, segs.lens, segs.slots)), segs.host_starts,
                        segs.host_lens, segs.host_slots)
    x, a, bt, y0, slices = make_case(len(slots), shape, dtype, seed=len(slots), device=DEVICE, wdtype=wdtype)
    mag = magnitudes(y0, x, a, bt, segs, slices)

    xa = lora_shrink_triton(x, a, segs)
    want_xa = lora_shrink_ref(x, a, segs)
    assert_within(xa, want_xa, (x.abs().double() @ a.abs().double().transpose(1, 2)).amax(0))

    y = lora_expand_triton(y0.clone(), want_xa, bt, segs, slices)
    assert_updated_like_reference(y, y0, lora_expand_ref(y0.clone(), want_xa, bt, segs, slices), mag, segs, slices)
    y = lora_apply(y0.clone(), x, a, bt, segs, slices, backend=KernelBackend.TRITON)
    assert_updated_like_reference(y, y0, lora_apply_ref(y0.clone(), x, a, bt, segs, slices), mag, segs, slices)


def test_triton_shrink_splits_k_over_programs():
    """One token and K of 1,000: the grid is one program a rank block, so K is split three ways and the programs add
    into xa atomically."""
    segs = segments([-1, 2])
    segs = LoraSegments(*(t.to(DEVICE) for t in (segs.starts, segs.lens, segs.slots)), segs.host_starts,
                        segs.host_lens, segs.host_slots)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1000, generator=g).to(DEVICE)
    a = torch.randn(NUM_SLOTS, 24, 1000, generator=g).to(DEVICE)
    assert_within(lora_shrink_triton(x, a, segs), lora_shrink_ref(x, a, segs),
                  (x.abs().double() @ a.abs().double().transpose(1, 2)).amax(0))


def test_segments_from_token_slots():
    segs = LoraSegments.from_token_slots(np.array([-1, 2, 2, -1, -1, 0, 1, 1, 2, -1, 2], dtype=np.int64))
    assert segs.host_starts.tolist() == [1, 5, 6, 8, 10]
    assert segs.host_lens.tolist() == [2, 1, 2, 1, 1]
    assert segs.host_slots.tolist() == [2, 0, 1, 2, 2]  # a slot in separate runs: a segment each
    assert segs.num_segments == 5
    for host, dev in ((segs.host_starts, segs.starts), (segs.host_lens, segs.lens), (segs.host_slots, segs.slots)):
        assert host.dtype == np.int32 and dev.dtype == torch.int32 and dev.tolist() == host.tolist()
    one = LoraSegments.from_token_slots(np.array([4], dtype=np.int32))
    assert (one.host_starts.tolist(), one.host_lens.tolist(), one.host_slots.tolist()) == ([0], [1], [4])
    whole = LoraSegments.from_token_slots(np.zeros(9, dtype=np.int32))
    assert (whole.host_starts.tolist(), whole.host_lens.tolist(), whole.host_slots.tolist()) == ([0], [9], [0])
    assert LoraSegments.from_token_slots(np.zeros(0, dtype=np.int32)) is None
    assert LoraSegments.from_token_slots(np.array([-1, -1], dtype=np.int32)) is None
