"""Gated activations of the fused gate_up projection: silu(gate) * up (SwiGLU, Llama) and
gelu_tanh(gate) * up (GeGLU, Gemma's gelu_pytorch_tanh). Called by the model's MLP. One Triton kernel
takes the activation as a constexpr; on CPU silu has a C kernel, gelu_tanh runs the torch reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.backend import runs_triton


def silu_and_mul_ref(x: Tensor) -> Tensor:
    """x [T, 2I] -> [T, I]; HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) with gate first."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def gelu_tanh_and_mul_ref(x: Tensor) -> Tensor:
    """x [T, 2I] -> [T, I]; HF GemmaMLP's gelu_pytorch_tanh(gate_proj(x)) * up_proj(x) with gate first."""
    inter = x.shape[-1] // 2
    return F.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr, GELU: tl.constexpr):
    # int64: token * x_stride passes 2**31 past about 75k tokens at intermediate size 14336.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * x_stride + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (e^2u + 1) (no libdevice tanh in the interpreter)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
        # tanh(30) is 1 in float32: the clamp changes nothing but keeps exp finite
        act = 0.5 * g * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * u, 60.0)) + 1.0))
    else:
        act = g / (1.0 + tl.exp(-g))
    # Round the activation to the input dtype before the multiply, as torch's two separate ops do.
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: Tensor, gelu: bool = False) -> Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.is_floating_point(), x.dtype
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, GELU=gelu, num_warps=4
    )
    return out


def silu_and_mul(x: Tensor, backend: KernelBackend | None = None) -> Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I] in x.dtype."""
    if runs_triton(x, backend):
        return silu_and_mul_triton(x)
    out = silu_and_mul_cpu(x)
    return silu_and_mul_ref(x) if out is None else out


def gelu_tanh_and_mul(x: Tensor, backend: KernelBackend | None = None) -> Tensor:
    """x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:], [T, I] in x.dtype."""
    if runs_triton(x, backend):
        return silu_and_mul_triton(x, gelu=True)
    return gelu_tanh_and_mul_ref(x)


def silu_and_mul_cpu(x: Tensor, lib=None) -> Tensor | None:
    """The C kernel (kernels/cpu/elementwise.c) for float32 or bfloat16 x [T, 2I] with unit column stride;
    None when it cannot run here. `lib`: a kernel library other than the default build (tests)."""
    from lightserve.kernels.cpu import C_DTYPES, library, profiled

    lib = lib or library()
    if lib is None or x.dtype not in C_DTYPES or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 2:
        return None
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)  # [T, I]
    with profiled("silu_and_mul_cpu"):  # visible in scripts/profile_step.py
        lib.silu_and_mul(x.data_ptr(), x.stride(0), rows, inter, out.data_ptr(), int(x.dtype == torch.bfloat16),
                         torch.get_num_threads())
    return out
