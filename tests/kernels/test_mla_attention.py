"""MLA: absorbed decode and up-projected prefill against naive float64 attention on up-projected K/V, and the
Triton latent decode kernel against the reference, over ragged lengths, masked head blocks and empty splits."""
import pytest
import torch

from lightserve.kernels.decode_attention import SPLIT_BUCKETS
from lightserve.kernels.launch_keys import record_launches
from lightserve.kernels.mla_attention import (
    mla_decode,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
    mla_prefill_attention,
    store_latent,
    warm_up_mla_decode_attention,
)
from tests.kernels.kernel_cases import DEVICE, TOL, make_kv_batch

SEQ_LENS = [1, 23, 70, 16]
NOPE, ROPE, VDIM = 32, 16, 32


def _case(seq_lens, num_heads, rank, dtype, seed=0):
    batch = make_kv_batch(seq_lens, 1, rank + ROPE, dtype, seed)  # k_cache is the latent pool [rows, 1, R + Dr]
    g = torch.Generator().manual_seed(seed + 1)
    kv_b = (torch.randn(num_heads * (NOPE + VDIM), rank, generator=g) / rank ** 0.5).to(DEVICE, dtype)
    meta = {"req_to_token": batch.req_to_token, "req_rows": batch.req_rows,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), "max_seq_len": max(seq_lens),
            "sm_scale": (NOPE + ROPE) ** -0.5}
    return batch, kv_b, meta, g


def _naive(batch, kv_b, req, q_nope, q_pe, positions, sm_scale):
    """Float64 causal attention of one request's queries over K/V up-projected from its latents."""
    num_heads, rank = q_nope.shape[1], kv_b.shape[1]
    lat = batch.k_cache[batch.req_to_token[batch.req_rows[req], :batch.seq_lens[req]].long(), 0].double()
    kv = (lat[:, :rank] @ kv_b.double().T).view(-1, num_heads, NOPE + VDIM)  # [L, H, Dn + Dv]
    k = torch.cat([kv[..., :NOPE], lat[:, None, rank:].expand(-1, num_heads, -1)], dim=-1)  # [L, H, Dn + Dr]
    q = torch.cat([q_nope, q_pe], dim=-1).double()  # [n, H, Dn + Dr]
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    visible = torch.arange(len(lat), device=q.device)[None, :] <= torch.tensor(positions, device=q.device)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, kv[..., NOPE:])  # [n, H, Dv]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_decode_matches_up_projected_attention(dtype):
    num_heads, rank = 4, 32
    batch, kv_b, meta, g = _case(SEQ_LENS, num_heads, rank, dtype)
    q_nope = torch.randn(len(SEQ_LENS), num_heads, NOPE, generator=g).to(DEVICE, dtype)
    q_pe = torch.randn(len(SEQ_LENS), num_heads, ROPE, generator=g).to(DEVICE, dtype)
    w = kv_b.view(num_heads, NOPE + VDIM, rank)
    out = mla_decode(q_nope, q_pe, batch.k_cache, w[:, :NOPE], w[:, NOPE:], **meta)
    assert out.shape == (len(SEQ_LENS), num_heads, VDIM) and not out.isnan().any()
    tol = TOL[dtype] if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for req, n in enumerate(SEQ_LENS):
        expect = _naive(batch, kv_b, req, q_nope[req:req + 1], q_pe[req:req + 1], [n - 1], meta["sm_scale"])
        torch.testing.assert_close(out[req:req + 1], expect.to(dtype), **tol)


def test_prefill_matches_naive_attention_with_cached_prefixes():
    num_heads, rank = 4, 32
    seq_lens, prefix_lens = [9, 23, 5], [0, 17, 4]  # a fresh prompt, a chunk after a prefix, a one-token chunk
    batch, kv_b, meta, g = _case(seq_lens, num_heads, rank, torch.float32)
    extend = [s - p for s, p in zip(seq_lens, prefix_lens)]
    starts = [sum(extend[:i]) for i in range(len(extend))]
    q_nope = torch.randn(sum(extend), num_heads, NOPE, generator=g).to(DEVICE)
    q_pe = torch.randn(sum(extend), num_heads, ROPE, generator=g).to(DEVICE)
    def i32(xs):
        return torch.tensor(xs, dtype=torch.int32, device=DEVICE)
    out = mla_prefill_attention(q_nope, q_pe, batch.k_cache, kv_b, VDIM, batch.req_to_token, batch.req_rows,
                                i32(starts), i32(prefix_lens), i32(extend), meta["sm_scale"])
    for req, (start, n, p) in enumerate(zip(starts, extend, prefix_lens)):
        expect = _naive(batch, kv_b, req, q_nope[start:start + n], q_pe[start:start + n], list(range(p, p + n)),
                        meta["sm_scale"])
        torch.testing.assert_close(out[start:start + n], expect.float(), **TOL[torch.float32])


@pytest.mark.parametrize("num_heads, rank, dtype", [(4, 32, torch.float32), (19, 48, torch.float16),
                                                    (16, 32, torch.float16), (19, 32, torch.float32)]
                         + ([(16, 512, torch.bfloat16)] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("num_splits", [1, 4])  # 4 splits of a 1- or 16-token sequence: empty splits
def test_mla_decode_triton_matches_reference(num_heads, rank, dtype, num_splits):
    """19 heads: a partial head block; rank 48: masked latent lanes."""
    batch, _, meta, g = _case(SEQ_LENS, num_heads, rank, dtype)
    q = torch.randn(len(SEQ_LENS), num_heads, rank + ROPE, generator=g).to(DEVICE, dtype)
    q_latent, q_pe = q[..., :rank], q[..., rank:]  # strided views, as the model passes them
    out = mla_decode_attention_triton(q_latent, q_pe, batch.k_cache, **meta, num_splits=num_splits, block_n=16)
    expect = mla_decode_attention_ref(q_latent, q_pe, batch.k_cache, **meta)
    torch.testing.assert_close(out, expect, **TOL[dtype])


def test_store_latent_writes_rows_at_kv_locs():
    cache = torch.zeros(10, 1, 6, device=DEVICE)
    kv = torch.arange(18, dtype=torch.float32, device=DEVICE).view(3, 6)
    store_latent(kv[:, :4], kv[:, 4:].view(3, 1, 2), cache, torch.tensor([7, 2, 5], device=DEVICE))
    torch.testing.assert_close(cache[[7, 2, 5], 0], kv)
    assert cache[[0, 1, 3, 4, 6, 8, 9]].abs().sum() == 0


def _layer_queries(batch_size, num_heads, rank, g):
    """q_latent and q_pe laid out as MLAAttention passes them: q_latent a [B, H, R] transposed view of the bmm's
    [H, B, R] output (head stride B * R), q_pe the rope columns of the [B, H, Dn + Dr] query projection."""
    q_latent = torch.randn(num_heads, batch_size, rank, generator=g).to(DEVICE).transpose(0, 1)
    q_pe = torch.randn(batch_size, num_heads, NOPE + ROPE, generator=g).to(DEVICE)[..., NOPE:]
    return q_latent, q_pe


def test_warm_up_compiles_every_split_count():
    # rank 40: the head stride B * 40 is a multiple of 16 for some batch sizes only (not specialized on).
    num_heads, rank = 2, 40
    batch, _, meta, g = _case(SEQ_LENS, num_heads, rank, torch.float32)
    with record_launches() as warm:
        q_latent, q_pe = _layer_queries(1, num_heads, rank, g)
        warm_up_mla_decode_attention(q_latent, q_pe, batch.k_cache, meta["req_to_token"], meta["req_rows"][:1],
                                     meta["seq_lens"][:1])
    for kernel in ("_mla_decode_split_kernel", "_decode_merge_kernel"):
        splits = {entry[2] for name, spec in warm.keys if name == kernel for entry in spec if entry[0] == "NUM_SPLITS"}
        assert splits == set(SPLIT_BUCKETS), (kernel, splits)
    # Decode steps of 1 to 4 requests (default split counts): nothing the warm-up did not compile.
    with record_launches() as served:
        for batch_size in range(1, len(SEQ_LENS) + 1):
            q_latent, q_pe = _layer_queries(batch_size, num_heads, rank, g)
            seq_lens = meta["seq_lens"][:batch_size]
            out = mla_decode_attention_triton(q_latent, q_pe, batch.k_cache, meta["req_to_token"],
                                              meta["req_rows"][:batch_size], seq_lens, max(SEQ_LENS[:batch_size]),
                                              meta["sm_scale"])
            expect = mla_decode_attention_ref(q_latent, q_pe, batch.k_cache, meta["req_to_token"],
                                              meta["req_rows"][:batch_size], seq_lens, max(SEQ_LENS[:batch_size]),
                                              meta["sm_scale"])
            torch.testing.assert_close(out, expect, **TOL[torch.float32])
    assert served.keys <= warm.keys, sorted(served.keys - warm.keys, key=str)
