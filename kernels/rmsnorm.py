"""RMSNorm and fused residual-add + RMSNorm (LlamaRMSNorm). Called by the model before attention and MLP.

The reference is the spec; on GPU the Triton kernel runs one program per row, on CPU a C kernel
(kernels/cpu/elementwise.c) does for float32 and bfloat16, the reference for other dtypes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm, bit for bit: normalise in float32, round to x.dtype, then scale by weight."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = xf * torch.rsqrt(var + eps)
    return weight * y.to(x.dtype)


def add_rmsnorm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """residual += x in place (rounded to residual.dtype, like HF's `residual + hidden`), then RMSNorm of it."""
    residual.add_(x)
    return rmsnorm_ref(residual, weight, eps)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    x_stride, res_stride, out_stride,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * x_stride may pass 2**31 in a large step
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the residual dtype before normalising, as the unfused model does.
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    # HF rounds the normalised row to the input dtype before the weight multiply; keep that rounding.
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _launch(x, None, weight, eps)


def add_rmsnorm_triton(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype, x.dtype)
    assert residual.stride(1) == 1, residual.stride()
    return _launch(x, residual, weight, eps)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, backend: KernelBackend | None = None) -> Tensor:
    """x [T, H], weight [H] -> [T, H] in the promoted dtype of weight and x (as HF)."""
    if runs_triton(x, backend):
        return rmsnorm_triton(x, weight, eps)
    out = rmsnorm_cpu(x, None, weight, eps)
    return rmsnorm_ref(x, weight, eps) if out is None else out


def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                backend: KernelBackend | None = None) -> Tensor:
    """residual [T, H] becomes residual + x in place; returns rmsnorm(residual, weight, eps)."""
    if runs_triton(x, backend):
        return add_rmsnorm_triton(x, residual, weight, eps)
    out = rmsnorm_cpu(x, residual, weight, eps)
    return add_rmsnorm_ref(x, residual, weight, eps) if out is None else out


def rmsnorm_cpu(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, lib=None) -> Tensor | None:
    """The C kernel (kernels/cpu/elementwise.c), float32 or bfloat16 (x, weight and residual of one dtype):
    [T, H] -> [T, H]; with `residual` (contiguous [T, H]) it first adds x into it in place. None when it
    cannot run here (then nothing was modified). `lib`: a kernel library other than the default build (tests)."""
    from lightserve.kernels.cpu import C_DTYPES, library, profiled

    lib = lib or library()
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or x.dtype not in C_DTYPES or weight.dtype != x.dtype \
            or not weight.is_contiguous() \
            or (residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()
                                          or residual.shape != x.shape)):
        return None
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)  # [T, H]
    with profiled("rmsnorm_cpu"):  # visible in scripts/profile_step.py
        lib.rmsnorm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                    rows, hidden, eps, out.data_ptr(), int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), weight.shape
    assert x.is_floating_point() and weight.is_floating_point(), (x.dtype, weight.dtype)
    out = torch.empty(num_tokens, hidden, dtype=torch.result_type(weight, x), device=x.device)
    if num_tokens == 0:
        return out
    res = x if residual is None else residual  # a dummy pointer when HAS_RESIDUAL is off
    block = triton.next_power_of_2(hidden)
    _rmsnorm_kernel[(num_tokens,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
    )
    return out
