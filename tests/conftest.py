"""Shared pytest setup. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here,
before anything imports lightserve.kernels: without a GPU, Triton kernels run in the interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
