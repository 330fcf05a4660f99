"""Row offsets in the Triton kernels are int64: a row index times a row stride passes 2**31 in large steps
(75k tokens at intermediate size 14336) and in large KV caches (a KV row index times the row stride). Checked
with views whose rows sit 2**30 elements apart, so row 2 starts past 2**31; the storage is allocated (4 GiB of
address space) but only the touched pages are ever backed. Every kernel that indexes memory by a runtime row:
SiLU-and-mul, RMSNorm, rotary, store_kv, decode and prefill attention (token rows of q, KV rows of the cache), MLA
decode (latent rows), and the fused-MoE grouped GEMM (token rows of x, the experts' weights)."""
import os
import subprocess
import sys
import textwrap

import pytest

# Runs in a child: an int32 offset wraps to a negative address and crashes the process (SIGSEGV in the
# interpreter, an illegal address on a GPU), which must fail this test, not end the test session. The child runs
# the kernels where this session does: compiled on CUDA when present, else in the interpreter (conftest sets
# TRITON_INTERPRET in the environment the child inherits; set here too so the script runs on its own).
_CHILD = textwrap.dedent("""
    import os
    import sys

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from lightserve.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
    from lightserve.kernels.decode_attention import decode_attention_ref, decode_attention_triton
    from lightserve.kernels.kv_store import store_kv_triton
    from lightserve.kernels.mla_attention import mla_decode_attention_ref, mla_decode_attention_triton
    from lightserve.kernels.moe import ExpertWeights, fused_experts_ref, fused_experts_triton, topk_softmax
    from lightserve.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
    from lightserve.kernels.rmsnorm import rmsnorm_ref, rmsnorm_triton
    from lightserve.kernels.rotary import rotary_emb_ref, rotary_emb_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    STRIDE = 2**30 + 64                  # elements between rows: row 2 starts at 2**31 + 128
    WIDTH = 2048                         # elements of each row the cases use
    base = torch.empty(2 * STRIDE + WIDTH, dtype=torch.float16, device=dev)
    gen = torch.Generator().manual_seed(0)
    tol = {"atol": 2e-3, "rtol": 2e-3}

    def rows(shape, offset=0, scale=1.0):
        # [3, *shape] view of `base` whose rows sit STRIDE apart, filled with random values (only its pages touched)
        strides, inner = [], 1
        for n in reversed(shape):
            strides.insert(0, inner)
            inner *= n
        assert offset + inner <= WIDTH
        view = base.as_strided((3, *shape), (STRIDE, *strides), offset)
        view.copy_(torch.randn(3, *shape, generator=gen) * scale)
        return view

    def elementwise():
        x = rows((32,))                  # [3, 32]
        torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), **tol)
        w = torch.randn(32, generator=gen).to(dev, torch.float16)
        torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), **tol)
        q = x.view(3, 1, 32)             # [T, 1 head, D 32] with token stride 2**30 + 64
        k = torch.randn(3, 1, 32, generator=gen).to(dev, torch.float16)
        inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, device=dev).float() / 32))
        ang = torch.arange(16, device=dev).float()[:, None] * inv[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()  # [max_pos 16, D]: cos | sin halves
        pos = torch.tensor([1, 5, 9], device=dev)
        q_ref, k_ref = q.clone(), k.clone()
        rotary_emb_triton(q, k, pos, cos_sin)
        rotary_emb_ref(q_ref, k_ref, pos, cos_sin)
        torch.testing.assert_close(q, q_ref, **tol)

    def kv_rows():
        # A KV cache of 3 rows [3, Hk 1, D 32] (K and V side by side in each row), q [3 tokens, Hq 2, D 32]
        k_cache, v_cache, q = rows((1, 32)), rows((1, 32), 32), rows((2, 32), 64)
        req_to_token = torch.tensor([[2, 0, 1, 0]], dtype=torch.int32, device=dev)  # row 2 first: past 2**31
        return k_cache, v_cache, q, req_to_token

    def store_kv():
        k_cache, v_cache, _, _ = kv_rows()
        k = torch.randn(3, 1, 32, generator=gen).to(dev, torch.float16)
        v = torch.randn(3, 1, 32, generator=gen).to(dev, torch.float16)
        store_kv_triton(k, v, k_cache, v_cache, torch.tensor([2, 0, 1], device=dev))
        assert torch.equal(k_cache[[2, 0, 1]], k) and torch.equal(v_cache[[2, 0, 1]], v)

    def decode():
        k_cache, v_cache, q, req_to_token = kv_rows()
        meta = (req_to_token, torch.zeros(3, dtype=torch.int32, device=dev),
                torch.tensor([3, 1, 2], dtype=torch.int32, device=dev), 3, 32 ** -0.5)
        torch.testing.assert_close(decode_attention_triton(q, k_cache, v_cache, *meta),
                                   decode_attention_ref(q, k_cache, v_cache, *meta), **tol)

    def prefill():
        k_cache, v_cache, q, req_to_token = kv_rows()
        def i32(*xs):
            return torch.tensor(xs, dtype=torch.int32, device=dev)
        # One request of 3 new tokens (q rows 0-2, KV rows 2, 0, 1) after no prefix.
        meta = (req_to_token, i32(0), i32(0), i32(0), i32(3), 3, 32 ** -0.5)
        torch.testing.assert_close(prefill_attention_triton(q, k_cache, v_cache, *meta),
                                   prefill_attention_ref(q, k_cache, v_cache, *meta), **tol)

    def mla_decode():
        latent = rows((1, 32 + 16))      # [3 rows, 1, R 32 + Dr 16]
        q_latent = torch.randn(3, 2, 32, generator=gen).to(dev, torch.float16)
        q_pe = torch.randn(3, 2, 16, generator=gen).to(dev, torch.float16)
        meta = (torch.tensor([[2, 0, 1, 0]], dtype=torch.int32, device=dev),
                torch.zeros(3, dtype=torch.int32, device=dev), torch.tensor([3, 1, 2], dtype=torch.int32, device=dev),
                3, 48 ** -0.5)
        torch.testing.assert_close(mla_decode_attention_triton(q_latent, q_pe, latent, *meta),
                                   mla_decode_attention_ref(q_latent, q_pe, latent, *meta), **tol)

    def moe():
        # 3 tokens of x rows STRIDE apart, 3 experts whose weights sit STRIDE apart (expert 2 past 2**31).
        hidden, inter = 32, 16
        x = rows((hidden,))
        weights = ExpertWeights(rows((2 * inter, hidden), hidden, hidden ** -0.5),  # [E 3, 2I, H]
                                rows((hidden, inter), hidden + 2 * inter * hidden, inter ** -0.5))  # [E 3, H, I]
        route_w, ids = topk_softmax(torch.randn(3, 3, generator=gen).to(dev), 2, renormalize=True)
        ids[2] = torch.tensor([2, 1])    # the last token (row past 2**31) goes to the last expert
        torch.testing.assert_close(fused_experts_triton(x, weights, route_w, ids),
                                   fused_experts_ref(x, weights, route_w, ids), atol=2e-2, rtol=2e-2)

    for case in sys.argv[1:]:
        print("case", case, flush=True)
        globals()[case]()
        print("ok", case, flush=True)
""")

CASES = ["elementwise", "store_kv", "decode", "prefill", "mla_decode", "moe"]


@pytest.mark.timeout(300)
def test_row_offsets_past_two_to_the_31():
    # One child for every case (one import of torch and triton): each prints "case" before and "ok" after, so a
    # crash names its case. The child touches a few pages per row, not the 4 GiB mapped.
    proc = subprocess.run([sys.executable, "-c", _CHILD, *CASES], capture_output=True, text=True, timeout=290,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    done = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    started = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("case ")]
    assert proc.returncode == 0 and done == CASES, (
        f"failed in case {started[-1] if started else None} (exit {proc.returncode}): {proc.stderr[-3000:]}")
