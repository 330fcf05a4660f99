"""Row offsets in the Triton kernels are int64: a row index times a row stride passes 2**31 in large steps
(75k tokens at intermediate size 14336). Checked with a view whose rows sit 2**30 elements apart, so row 2
starts past 2**31; the storage is allocated but only the touched pages are ever backed."""
import subprocess
import sys
import textwrap

import pytest

# Runs in a child: an int32 offset wraps to a negative address and crashes the process (SIGSEGV in the
# interpreter), which must fail this test, not end the test session.
_CHILD = textwrap.dedent("""
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from lightserve.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
    from lightserve.kernels.rmsnorm import rmsnorm_ref, rmsnorm_triton
    from lightserve.kernels.rotary import rotary_emb_ref, rotary_emb_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    stride = 2**30 + 64                      # elements between rows: row 2 starts at 2**31 + 128
    width = 32
    base = torch.empty(2 * stride + width, dtype=torch.float16, device=dev)
    x = base.as_strided((3, width), (stride, 1))  # [3, width], rows 0, 2**30 + 64, 2**31 + 128
    x.copy_(torch.randn(3, width, device=dev))
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=2e-3, rtol=2e-3)
    w = torch.randn(width, dtype=torch.float16, device=dev)
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), atol=2e-3, rtol=2e-3)
    q = x.view(3, 1, width)                  # [T, 1 head, D 32] with token stride 2**30 + 64
    k = torch.randn(3, 1, width, dtype=torch.float16, device=dev)
    inv = 1.0 / (10000.0 ** (torch.arange(0, width, 2, device=dev).float() / width))
    ang = torch.arange(16, device=dev).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()  # [max_pos 16, D]: cos | sin halves
    pos = torch.tensor([1, 5, 9], device=dev)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_emb_triton(q, k, pos, cos_sin)
    rotary_emb_ref(q_ref, k_ref, pos, cos_sin)
    torch.testing.assert_close(q, q_ref, atol=2e-3, rtol=2e-3)
    print("ok")
""")


@pytest.mark.timeout(120)
def test_row_offsets_past_two_to_the_31():
    # The child touches a few pages per row (about 300 MB resident in the interpreter), not the 4 GiB mapped.
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.returncode, proc.stderr[-2000:])

