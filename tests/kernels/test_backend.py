"""--kernel_backend resolved once (kernels/backend.py): auto by device, the pairs that cannot run refused with the
flag named, and every dispatcher choosing Triton or the CPU path by the resolved value, not by the tensor's device."""
from __future__ import annotations

import importlib

import pytest
import torch

from lightserve import kernels
from lightserve.cli import parse_args
from lightserve.config import KernelBackend
from lightserve.kernels.backend import resolve_kernel_backend, runs_triton


def test_auto_resolves_by_device_and_impossible_pairs_name_the_flag(monkeypatch):
    assert resolve_kernel_backend(KernelBackend.AUTO, "cpu") is KernelBackend.CPU
    assert resolve_kernel_backend(None, "cuda") is KernelBackend.TRITON
    assert resolve_kernel_backend("triton", "cuda") is KernelBackend.TRITON
    with pytest.raises(ValueError, match="--kernel_backend cpu"):
        resolve_kernel_backend(KernelBackend.CPU, torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernel_backend("triton", "cpu") is KernelBackend.TRITON
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_kernel_backend("triton", "cpu")


def test_the_flag_parses_and_refuses_unknown_values(capsys):
    assert parse_args([]).kernel_backend is KernelBackend.AUTO
    assert parse_args(["--kernel-backend", "triton"]).kernel_backend is KernelBackend.TRITON
    with pytest.raises(SystemExit):
        parse_args(["--kernel_backend", "cuda"])
    assert "--kernel_backend" in capsys.readouterr().err


def test_dispatchers_follow_the_resolved_backend_on_cpu_tensors(monkeypatch):
    x = torch.randn(3, 8)
    assert not runs_triton(x) and not runs_triton(x, KernelBackend.CPU) and runs_triton(x, KernelBackend.TRITON)
    calls = []
    module = importlib.import_module("lightserve.kernels.rmsnorm")  # the package re-exports a function of that name
    monkeypatch.setattr(module, "rmsnorm_triton", lambda *a: calls.append("triton") or a[0])
    monkeypatch.setattr(module, "rmsnorm_cpu", lambda *a: calls.append("cpu") or a[0])
    w = torch.ones(8)
    kernels.rmsnorm(x, w, 1e-6, KernelBackend.TRITON)
    kernels.rmsnorm(x, w, 1e-6, KernelBackend.CPU)
    kernels.rmsnorm(x, w, 1e-6)
    assert calls == ["triton", "cpu", "cpu"]
