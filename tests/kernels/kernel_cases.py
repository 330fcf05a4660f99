"""Shared by the kernel tests: device, tolerances, head layouts, a ragged batch in a token-level KV cache, and
naive attention. On a GPU machine the Triton kernels run for real (and bf16 dots are tested); elsewhere the tests
run them in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (num_q_heads, num_kv_heads): GQA ratios 1, 4 and 8 with few heads, since the interpreter is slow.
HEAD_LAYOUTS = [(2, 2), (4, 1), (8, 1)]
# Each GQA ratio meets both head dims and both dtypes across the list, without the full cross product.
# In the interpreter fp32 and fp16 only: its bf16 tl.dot is garbage, so bf16 dots are tested on a GPU only.
KERNEL_CASES = [
    (2, 2, 64, torch.float32), (2, 2, 128, torch.float16), (4, 1, 64, torch.float16),
    (4, 1, 128, torch.float32), (8, 1, 64, torch.float32), (8, 1, 128, torch.float16),
    # head_dim 80 and 96 are no powers of two: the kernels pad them to BLOCK_D = 128 with masked lanes.
    (4, 1, 80, torch.float32), (4, 2, 96, torch.float16),
] + ([(4, 1, 64, torch.bfloat16), (8, 1, 128, torch.bfloat16)] if DEVICE.type == "cuda" else [])
# Two builds of decode_attention.c with other compile-time choices (kernels/cpu TUNABLES), each ~10 s to compile:
# tests/kernels/test_decode_attention.py checks them and tests/scripts/test_bench_cpu_kernels.py times them, so the
# build cache compiles them once for both.
# HEAD_OUTER is each build's default in one of them and its opposite in the other, so both loop orders run on every
# CPU.
DECODE_TUNINGS = [{"PF_LOCALITY": -1, "PF_DIST": 0, "PACK_MIN_GROUP": 17, "DPV_MIN_GROUP": 17, "HEAD_OUTER": 1},
                  {"PF_LOCALITY": 3, "PF_DIST": 100, "PACK_MIN_GROUP": 5, "DPV_MIN_GROUP": 1, "SHARE_K": 0,
                   "HEAD_OUTER": 0}]
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@dataclass
class KVBatch:
    k_cache: torch.Tensor  # [num_rows, Hk, D] (head_major: a view of [Hk, num_rows, D]); rows no request owns
    # hold NaN, so any stray read shows up
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [B + 2, max_len + 3] int32; slots past a request's length point at NaN rows
    req_rows: torch.Tensor  # [B] int32, shuffled rows of req_to_token
    seq_lens: list[int]


def make_kv_batch(seq_lens, num_kv_heads, head_dim, dtype, seed=0, head_major=False) -> KVBatch:
    gen = torch.Generator().manual_seed(seed)
    num_used = sum(seq_lens)
    num_rows = num_used + 7
    rows = torch.randperm(num_rows, generator=gen)  # requests' tokens scattered through the cache
    shape = (num_kv_heads, num_rows, head_dim) if head_major else (num_rows, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    if head_major:  # the same [num_rows, Hk, D] indexing, head stride num_rows * D
        k_cache, v_cache = k_cache.transpose(0, 1), v_cache.transpose(0, 1)
    used = rows[:num_used]
    k_cache[used] = torch.randn(num_used, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache[used] = torch.randn(num_used, num_kv_heads, head_dim, generator=gen).to(dtype)
    batch = len(seq_lens)
    req_to_token = torch.full((batch + 2, max(seq_lens) + 3), int(rows[-1]), dtype=torch.int32)  # a NaN row
    req_rows = torch.randperm(batch + 2, generator=gen)[:batch].to(torch.int32)
    offset = 0
    for row, n in zip(req_rows.tolist(), seq_lens):
        req_to_token[row, :n] = used[offset:offset + n].to(torch.int32)
        offset += n
    return KVBatch(k_cache.to(DEVICE), v_cache.to(DEVICE), req_to_token.to(DEVICE), req_rows.to(DEVICE),
                   list(seq_lens))


def naive_attention(batch: KVBatch, req: int, q: torch.Tensor, positions: list[int], sm_scale: float,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Dense float64 softmax attention of q [n, Hq, D] (at positions) over request req's tokens; causal, and
    with window > 0 limited to the last `window` keys; with softcap > 0 scores are softcap * tanh(s / softcap)."""
    locs = batch.req_to_token[batch.req_rows[req], :batch.seq_lens[req]].long()
    group = q.shape[1] // batch.k_cache.shape[1]
    k = batch.k_cache[locs].double().repeat_interleave(group, dim=1)  # [L, Hq, D]; head h uses KV head h // group
    v = batch.v_cache[locs].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * sm_scale  # [Hq, n, L]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(len(locs), device=q.device)[None, :]
    query_pos = torch.tensor(positions, device=q.device)[:, None]
    visible = key_pos <= query_pos
    if window > 0:
        visible &= key_pos > query_pos - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [n, Hq, D]


# (window, softcap) variants of the attention kernels: a window shorter than most requests, one longer than
# some, a softcap with scores that reach it (sm_scale is raised in those cases), and both together.
VARIANTS = [(8, 0.0), (40, 0.0), (0, 1.5), (5, 2.0)]


def window_softcap_meta(meta: dict, window: int, softcap: float) -> dict:
    """An attention case's keyword arguments with a window and softcap; with a softcap the scores are scaled up
    (8x) so that tanh saturates for some keys, where the cap matters."""
    scale = meta["sm_scale"] * (8.0 if softcap else 1.0)
    return {**meta, "sm_scale": scale, "window": window, "softcap": softcap}


def portable_library():
    """The C kernels built with AVX2 and FMA off (cached like any build): the plain-C paths that a CPU
    without AVX2 runs, tested here on one that has it."""
    from lightserve.kernels.cpu import variant_library

    return variant_library("portable")


def c_library_variants() -> list[str]:
    """The C kernel builds this CPU can run (native, and narrower vector widths where it has wider ones):
    the kernels are one source that each build compiles to its own instructions, so each is tested."""
    from lightserve.kernels.cpu import BUILD_VARIANTS, library, variant_library

    if library() is None:
        return []
    return [name for name in BUILD_VARIANTS if variant_library(name) is not None]
