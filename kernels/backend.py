"""Which kernels a forward runs, resolved once from `--kernel_backend` and carried by the model; every dispatcher in
kernels/ asks `runs_triton`.

- `triton`: the GPU code path: Triton kernels, F.linear, the token-major KV layout, no CPU weight packing. On CUDA
  tensors it runs compiled; on CPU tensors under TRITON_INTERPRET=1 the same launches run in Triton's interpreter,
  which is how the tests chain the GPU kernels through a whole model without a GPU.
- `cpu`: the C kernels of kernels/cpu/ (torch references where none applies), on CPU tensors only.
- `auto`: triton on CUDA, cpu on CPU.
`KernelBackend` itself lives in lightserve/config.py beside the flag's other enums.
"""
from __future__ import annotations

import os

import torch

from lightserve.config import KernelBackend


def resolve_kernel_backend(backend: KernelBackend | str | None, device: torch.device | str) -> KernelBackend:
    """TRITON or CPU for a model on `device`. ValueError names the flag where the pair cannot run: the C kernels
    read host memory, and Triton on CPU needs the interpreter switched on before any kernel is defined."""
    backend = KernelBackend(backend or KernelBackend.AUTO)
    on_cuda = torch.device(device).type == "cuda"
    if backend is KernelBackend.AUTO:
        return KernelBackend.TRITON if on_cuda else KernelBackend.CPU
    if backend is KernelBackend.CPU and on_cuda:
        raise ValueError("--kernel_backend cpu: the C kernels run on CPU tensors; use triton (or auto) on CUDA")
    if backend is KernelBackend.TRITON and not on_cuda and not interpreter_on():
        raise ValueError("--kernel_backend triton on CPU needs TRITON_INTERPRET=1 in the environment before start "
                         "(the launcher sets it for its worker ranks)")
    return backend


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its interpreter (read by triton.jit when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_triton(x: torch.Tensor, backend: KernelBackend | None = None) -> bool:
    """Whether a dispatcher launches its Triton kernel for input `x`. `backend` None or AUTO: by x's device (kernel
    tests and library callers); TRITON or CPU: as resolved for the model."""
    if backend is None or backend is KernelBackend.AUTO:
        return x.is_cuda
    return backend is KernelBackend.TRITON
