"""LoRA's segmented shrink and expand (S-LoRA/Punica's SGMV): the low-rank products of many adapters in one batch.

A step's tokens are grouped into segments, runs of consecutive tokens under one adapter; tokens under the base model
belong to no segment. Each adapter occupies a slot of stacked, rank-padded weights (model_infer/lora.py loads them):

    shrink:  xa[t, :]                   = x[t, :] @ A[slot]^T                    A: [num_slots, R, K]
    expand:  y[t, n0:n0+nj] += xa[t, r0:r0+rj] @ BT[slot][r0:r0+rj, n0:n0+nj]    BT: [num_slots, R, N]

A fused projection (q/k/v, gate/up) is one shrink over its A's stacked along R and one expand whose slices map each
rank block to its own output columns. The adapter's scaling (alpha/r, rsLoRA's alpha/sqrt(r)) is folded into BT at
load. A and BT are stored in --lora_dtype (float32, bfloat16 or float16, both the same) whatever the activation dtype,
and every kernel widens them to float32 as it loads them: products and sums are float32, so bf16 stacks only halve
the bytes read (at batch 1 the product is bound by them); xa is float32; y is updated in place.

The model calls `lora_apply` (shrink then expand, one C call on CPU: a ctypes call costs 5-10 us and a step makes four
LoRA products a layer); `lora_shrink` and `lora_expand` are its halves. Each dispatches to Triton where runs_triton
says so (segment-parallel kernels below: a grid over segments x token blocks x output blocks), to
kernels/cpu/lora.c on CPU for float32 and bfloat16 activations and weights, else (float16 on CPU) to the reference.
The file holds the op's reference, its C wrappers and its Triton kernels together (one op, one file), hence its length.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels import cpu as cpu_kernels
from lightserve.kernels.backend import runs_triton


@dataclass(frozen=True)
class LoraSegments:
    """The step's adapter segments: tokens [starts[s], starts[s] + lens[s]) run under slot slots[s]. int32 [S] on
    the weights' device, and the same on the host (`host_*`, numpy) for code that loops without a device sync."""
    starts: Tensor
    lens: Tensor
    slots: Tensor
    host_starts: np.ndarray
    host_lens: np.ndarray
    host_slots: np.ndarray

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray, device: torch.device | str = "cpu") -> LoraSegments | None:
        """Segments of a [T] int32 array of each token's slot (-1: the base model); None when no token has one."""
        t = token_slots.shape[0]
        if t == 0 or not (token_slots >= 0).any():
            return None
        change = np.flatnonzero(np.diff(token_slots)) + 1                     # where a run starts, past token 0
        starts = np.concatenate([[0], change]).astype(np.int32)               # [runs]
        lens = np.diff(np.concatenate([starts, [t]])).astype(np.int32)        # [runs]
        slots = token_slots[starts].astype(np.int32)                          # [runs]
        keep = slots >= 0
        starts, lens, slots = starts[keep], lens[keep], slots[keep]
        dev = torch.device(device)
        return cls(*(torch.from_numpy(a).to(dev) for a in (starts, lens, slots)), starts, lens, slots)

    @property
    def num_segments(self) -> int:
        return int(self.host_starts.shape[0])

    @functools.cached_property
    def host_c_args(self) -> tuple[int, int, int, int]:
        """(starts, lens, slots pointers, S) of int32 host copies, for the C kernels: worked out once per step, not
        once per call (a numpy array's ctypes pointer costs about a microsecond)."""
        arrays = tuple(np.ascontiguousarray(a, dtype=np.int32) for a in
                       (self.host_starts, self.host_lens, self.host_slots))
        object.__setattr__(self, "_host_c_arrays", arrays)  # kept alive while the pointers are in use
        return (*(a.ctypes.data for a in arrays), self.num_segments)


# A slice of an expand: (r0, rj, n0, nj): rank rows [r0, r0 + rj) of BT write output columns [n0, n0 + nj).
Slice = tuple[int, int, int, int]


def lora_shrink_ref(x: Tensor, a: Tensor, segs: LoraSegments) -> Tensor:
    """x [T, K] (model dtype), a [num_slots, R, K] (its dtype widened to float32) -> xa [T, R] float32; rows outside
    every segment zero."""
    xa = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s0, n, slot in zip(segs.host_starts.tolist(), segs.host_lens.tolist(), segs.host_slots.tolist()):
        xa[s0:s0 + n] = x[s0:s0 + n].float() @ a[slot].float().t()
    return xa


def lora_expand_ref(y: Tensor, xa: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...]) -> Tensor:
    """y [T, N] (model dtype) += each slice's xa [T, R] block @ bt [num_slots, R, N] block (bt's dtype widened), in
    float32, rounded once to y's dtype; rows outside every segment untouched. Returns y."""
    for s0, n, slot in zip(segs.host_starts.tolist(), segs.host_lens.tolist(), segs.host_slots.tolist()):
        rows = y[s0:s0 + n]
        for r0, rj, n0, nj in slices:
            delta = xa[s0:s0 + n, r0:r0 + rj] @ bt[slot, r0:r0 + rj, n0:n0 + nj].float()   # [n, nj] float32
            rows[:, n0:n0 + nj] = (rows[:, n0:n0 + nj].float() + delta).to(y.dtype)
    return y


def lora_apply_ref(y: Tensor, x: Tensor, a: Tensor, bt: Tensor, segs: LoraSegments,
                   slices: tuple[Slice, ...]) -> Tensor:
    """lora_shrink_ref then lora_expand_ref: y [T, N] += the LoRA product of x [T, K], in place. Returns y."""
    return lora_expand_ref(y, lora_shrink_ref(x, a, segs), bt, segs, slices)


def lora_shrink(x: Tensor, a: Tensor, segs: LoraSegments, backend: KernelBackend | None = None) -> Tensor:
    """lora_shrink_ref's result by the fastest kernel for x's device and dtype: xa [T, R] float32."""
    if runs_triton(x, backend):
        return lora_shrink_triton(x, a, segs)
    out = lora_shrink_cpu(x, a, segs)
    return lora_shrink_ref(x, a, segs) if out is None else out


def lora_expand(y: Tensor, xa: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...],
                backend: KernelBackend | None = None) -> Tensor:
    """lora_expand_ref's update of y in place by the fastest kernel for y's device and dtype. Returns y."""
    if segs.num_segments == 0:
        return y
    if runs_triton(y, backend):
        return lora_expand_triton(y, xa, bt, segs, slices)
    if lora_expand_cpu(y, xa, bt, segs, slices) is None:
        lora_expand_ref(y, xa, bt, segs, slices)
    return y


def lora_apply(y: Tensor, x: Tensor, a: Tensor, bt: Tensor, segs: LoraSegments | None, slices: tuple[Slice, ...],
               backend: KernelBackend | None = None) -> Tensor:
    """y [T, N] += the LoRA product of x [T, K] in place (lora_apply_ref's result), shrink and expand in one C call on
    CPU and two launches on Triton; segs None (no token under an adapter) leaves y as it is. Returns y.
    ValueError (C path) for segments or slices out of range."""
    if segs is None or segs.num_segments == 0:
        return y
    if runs_triton(y, backend):
        return lora_expand_triton(y, lora_shrink_triton(x, a, segs), bt, segs, slices)
    if lora_apply_cpu(y, x, a, bt, segs, slices) is None:
        lora_apply_ref(y, x, a, bt, segs, slices)
    return y


# ---------------------------------------------------------------------------------------------------------------
# CPU: kernels/cpu/lora.c. Each wrapper returns None where the C kernel does not run (no library, a non-CPU tensor,
# another dtype or layout: float16 activations or weights); `lib` is a kernel library other than the default build
# (tests of each build).
# cpu_kernels.library is looked up at each call, so a test that patches it out sends these to the reference.

def lora_shrink_cpu(x: Tensor, a: Tensor, segs: LoraSegments, lib=None) -> Tensor | None:
    """lora.c's lora_shrink: x [T, K] float32 or bf16 (rows may be strided), a [num_slots, R, K] float32 or bf16 ->
    xa [T, R] float32."""
    lib = lib or cpu_kernels.library()
    if lib is None or not (x.is_cpu and a.is_cpu) or x.dtype not in cpu_kernels.C_DTYPES or x.stride(1) != 1 \
            or a.dtype not in cpu_kernels.C_DTYPES:
        return None
    t, k = x.shape
    num_slots, r, _ = a.shape
    assert a.shape == (num_slots, r, k), (x.shape, a.shape)
    a = a.contiguous()
    xa = torch.empty(t, r, dtype=torch.float32)  # [T, R]; the kernel zeroes the rows outside every segment
    with cpu_kernels.profiled("lora_cpu"):  # visible in scripts/profile_step.py
        rc = lib.lora_shrink(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, t, k, a.data_ptr(),
                             a.dtype == torch.bfloat16, num_slots, r, *segs.host_c_args, xa.data_ptr(),
                             torch.get_num_threads())
    return _checked(rc, xa)


def lora_expand_cpu(y: Tensor, xa: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...],
                    lib=None) -> Tensor | None:
    """lora.c's lora_expand: y [T, N] float32 or bf16 (rows may be strided) += xa [T, R] float32 (rows may be
    strided) by bt [num_slots, R, N] float32 or bf16, in place. Returns y."""
    lib = lib or cpu_kernels.library()
    if lib is None or not (y.is_cpu and xa.is_cpu and bt.is_cpu) or y.dtype not in cpu_kernels.C_DTYPES \
            or y.stride(1) != 1 or xa.dtype != torch.float32 or xa.stride(1) != 1 \
            or bt.dtype not in cpu_kernels.C_DTYPES:
        return None
    t, n = y.shape
    num_slots, r, _ = bt.shape
    assert bt.shape == (num_slots, r, n) and xa.shape == (t, r), (y.shape, xa.shape, bt.shape)
    bt = bt.contiguous()
    table, num_slices = _c_slices(slices if type(slices) is tuple else _as_slices(slices))
    with cpu_kernels.profiled("lora_cpu"):
        rc = lib.lora_expand(y.data_ptr(), y.stride(0), y.dtype == torch.bfloat16, t, n, xa.data_ptr(),
                             xa.stride(0), bt.data_ptr(), bt.dtype == torch.bfloat16, num_slots, r,
                             *segs.host_c_args, table, num_slices, torch.get_num_threads())
    return _checked(rc, y)


def lora_apply_cpu(y: Tensor, x: Tensor, a: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...],
                   lib=None) -> Tensor | None:
    """lora.c's lora_apply, shrink and expand in one call (xa in a scratch buffer of the kernel's): y [T, N] and
    x [T, K] float32 or bf16 (rows of each may be strided), a [num_slots, R, K] and bt [num_slots, R, N] float32 or
    bf16 (the same); y updated in place. Returns y."""
    # NOTE: the model calls this 4 times a layer in every step, so the checks are kept to cheap attribute reads
    # (a batch-1 call of SmolLM2's shapes is about 10 us in all, half of it ctypes' argument conversion).
    lib = lib or cpu_kernels.library()
    if lib is None or not (y.is_cpu and x.is_cpu and a.is_cpu and bt.is_cpu) \
            or y.dtype not in cpu_kernels.C_DTYPES or x.dtype not in cpu_kernels.C_DTYPES \
            or a.dtype not in cpu_kernels.C_DTYPES or bt.dtype != a.dtype or y.stride(1) != 1 or x.stride(1) != 1:
        return None
    t, n = y.shape
    num_slots, r, k = a.shape
    assert x.shape == (t, k) and bt.shape == (num_slots, r, n), (y.shape, x.shape, a.shape, bt.shape)
    a, bt = a.contiguous(), bt.contiguous()
    table, num_slices = _c_slices(slices if type(slices) is tuple else _as_slices(slices))
    with cpu_kernels.profiled("lora_cpu"):
        rc = lib.lora_apply(y.data_ptr(), y.stride(0), y.dtype == torch.bfloat16, x.data_ptr(), x.stride(0),
                            x.dtype == torch.bfloat16, t, k, n, a.data_ptr(), bt.data_ptr(), a.dtype == torch.bfloat16,
                            num_slots, r, *segs.host_c_args, table, num_slices, torch.get_num_threads())
    return _checked(rc, y)


# ---------------------------------------------------------------------------------------------------------------
# Triton: segment-parallel. Program (segment x token block, output block[, K split]); a segment's tokens fill the
# BLOCK_T rows of a tile, so each program reads its block of A[slot] or BT[slot] once for up to BLOCK_T tokens.
# A and BT are loaded in their dtype (half the bytes in bf16/fp16) and widened to float32 in registers; products in
# float32 (input_precision "ieee": the reference's float32 GEMM, not tf32's 10-bit operands).

_BLOCK_T = 16  # tl.dot's smallest tile side; a decode segment of 1-8 tokens leaves the rest masked
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of A and BT (--lora_dtype)


@triton.jit(do_not_specialize=["token_blocks", "k_per_split"])
def _shrink_kernel(
    x_ptr, a_ptr, xa_ptr, starts_ptr, lens_ptr, slots_ptr,
    x_row, K, R, token_blocks, k_per_split,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    seg, tb = pid // token_blocks, pid % token_blocks
    n = tl.load(lens_ptr + seg)
    if tb * BLOCK_T >= n:  # the grid covers the longest segment
        return
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n
    rows = (tl.load(starts_ptr + seg) + offs_t).to(tl.int64)  # [BLOCK_T]
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + tl.load(slots_ptr + seg).to(tl.int64) * R * K
    k_begin = tl.program_id(2) * k_per_split  # k_per_split: a multiple of BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_begin + k0 + offs_k
        k_mask = kk < K
        xt = tl.load(x_ptr + rows[:, None] * x_row + kk[None, :], mask=t_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_K]
        at = tl.load(a_base + offs_r[None, :] * K + kk[:, None], mask=k_mask[:, None] & r_mask[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(xt, at, input_precision="ieee")
    out = xa_ptr + rows[:, None] * R + offs_r[None, :]
    if SPLIT:  # the K splits of a tile add into xa, which starts at zero
        tl.atomic_add(out, acc, mask=t_mask[:, None] & r_mask[None, :])
    else:
        tl.store(out, acc, mask=t_mask[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["token_blocks"])
def _expand_kernel(
    y_ptr, xa_ptr, bt_ptr, starts_ptr, lens_ptr, slots_ptr, slices_ptr,
    y_row, xa_row, R, N, token_blocks,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    seg, tb = pid // token_blocks, pid % token_blocks
    n = tl.load(lens_ptr + seg)
    if tb * BLOCK_T >= n:
        return
    sl = slices_ptr + tl.program_id(2) * 4  # (r0, rj, n0, nj) of this program's slice
    r0, rj, n0, nj = tl.load(sl), tl.load(sl + 1), tl.load(sl + 2), tl.load(sl + 3)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(1) * BLOCK_N >= nj:  # the grid covers the widest slice
        return
    n_mask = offs_n < nj
    cols = n0 + offs_n
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < n
    rows = (tl.load(starts_ptr + seg) + offs_t).to(tl.int64)  # [BLOCK_T]
    bt_base = bt_ptr + tl.load(slots_ptr + seg).to(tl.int64) * R * N
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for rr in range(0, rj, BLOCK_R):
        ranks = rr + offs_r
        r_mask = ranks < rj
        xat = tl.load(xa_ptr + rows[:, None] * xa_row + (r0 + ranks)[None, :],
                      mask=t_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_T, BLOCK_R]
        btt = tl.load(bt_base + (r0 + ranks)[:, None] * N + cols[None, :], mask=r_mask[:, None] & n_mask[None, :],
                      other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        acc += tl.dot(xat, btt, input_precision="ieee")
    mask = t_mask[:, None] & n_mask[None, :]
    yp = y_ptr + rows[:, None] * y_row + cols[None, :]
    y = tl.load(yp, mask=mask, other=0.0)
    tl.store(yp, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)  # one rounding, as the reference


def lora_shrink_triton(x: Tensor, a: Tensor, segs: LoraSegments) -> Tensor:
    """x [T, K] (rows may be strided), a [num_slots, R, K] float32, bf16 or fp16 -> xa [T, R] float32. When the grid
    is too small to fill the GPU (a decode step of few segments), K is split across programs that add into xa
    atomically."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    t, k = x.shape
    num_slots, r, _ = a.shape
    assert a.shape == (num_slots, r, k) and a.dtype in _WEIGHT_DTYPES, (x.shape, a.shape, a.dtype)
    a = a.contiguous()
    xa = torch.zeros(t, r, dtype=torch.float32, device=x.device)  # [T, R]
    if segs.num_segments == 0 or t == 0:
        return xa
    token_blocks = triton.cdiv(int(segs.host_lens.max()), _BLOCK_T)
    block_r = min(max(triton.next_power_of_2(r), 16), 64)
    block_k = 64
    programs = segs.num_segments * token_blocks * triton.cdiv(r, block_r)
    split = max(1, min(k // 256, 128 // programs))  # about 128 programs in all, each at least 256 of K
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    grid = (segs.num_segments * token_blocks, triton.cdiv(r, block_r), split)
    _shrink_kernel[grid](x, a, xa, segs.starts, segs.lens, segs.slots, x.stride(0), k, r, token_blocks,
                         k_per_split, BLOCK_T=_BLOCK_T, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT=split > 1,
                         num_warps=4)
    return xa


def lora_expand_triton(y: Tensor, xa: Tensor, bt: Tensor, segs: LoraSegments, slices: tuple[Slice, ...]) -> Tensor:
    """y [T, N] (rows may be strided) += xa [T, R] float32 by bt [num_slots, R, N] float32, bf16 or fp16, in place,
    one launch for all slices. Returns y."""
    assert y.dim() == 2 and y.stride(1) == 1 and xa.stride(1) == 1, (y.shape, y.stride(), xa.stride())
    t, n = y.shape
    num_slots, r, _ = bt.shape
    assert bt.shape == (num_slots, r, n) and xa.shape == (t, r), (y.shape, xa.shape, bt.shape)
    assert bt.dtype in _WEIGHT_DTYPES and xa.dtype == torch.float32, (bt.dtype, xa.dtype)
    slices = _as_slices(slices)
    if segs.num_segments == 0 or not slices or t == 0:
        return y
    bt = bt.contiguous()
    token_blocks = triton.cdiv(int(segs.host_lens.max()), _BLOCK_T)
    block_n = 64
    widest = max(nj for _, _, _, nj in slices)
    grid = (segs.num_segments * token_blocks, max(triton.cdiv(widest, block_n), 1), len(slices))
    _expand_kernel[grid](y, xa, bt, segs.starts, segs.lens, segs.slots, _device_slices(slices, y.device),
                         y.stride(0), xa.stride(0), r, n, token_blocks, BLOCK_T=_BLOCK_T, BLOCK_R=16,
                         BLOCK_N=block_n, num_warps=4)
    return y


# ---------------------------------------------------------------------------------------------------------------

def _as_slices(slices) -> tuple[Slice, ...]:
    """slices as a hashable tuple of 4-tuples of ints (a caller may pass lists)."""
    return slices if isinstance(slices, tuple) and all(isinstance(s, tuple) for s in slices) \
        else tuple(tuple(int(v) for v in s) for s in slices)


@functools.lru_cache(maxsize=256)
def _c_slices(slices: tuple[Slice, ...]) -> tuple[ctypes.Array, int]:
    """(int32 [num_slices * 4] table, num_slices) for lora.c; a projection's slices are the same every step."""
    flat = [int(v) for s in slices for v in s]
    return (ctypes.c_int32 * max(len(flat), 1))(*flat), len(slices)


@functools.lru_cache(maxsize=256)
def _device_slices(slices: tuple[Slice, ...], device: torch.device) -> Tensor:
    """int32 [num_slices, 4] on the device, made once per (slices, device): no host-to-device copy per launch."""
    return torch.tensor(slices, dtype=torch.int32, device=device).reshape(-1, 4)


def _checked(rc: int, out: Tensor) -> Tensor | None:
    if rc == -1:
        raise ValueError("lora: a segment (start, len, slot) or slice (r0, rj, n0, nj) out of range of the tensors, "
                         "segments out of order, or slices whose output columns overlap")
    return out if rc == 0 else None
