"""Mixture of experts: routing (softmax top-k; DeepSeek-V3's grouped sigmoid top-k) and the routed experts' SwiGLU
MLPs applied to the tokens sent to them, weighted and summed per token. Called by model_infer/moe_layers.py.

The reference loops over experts as transformers does. On CPU the (token, k) pairs are sorted by expert and every
active expert runs one gate_up GEMM, SiLU-and-mul and one down GEMM through kernels.linear / kernels.silu_and_mul
(the C kernels on packed float32 weights, oneDNN on bf16), then a weighted index_add puts the rows back. On GPU the
pairs are sorted by expert and padded to whole BLOCK_M blocks (one expert per block), and one Triton grouped GEMM
per projection covers every expert (vLLM's fused MoE layout); the down GEMM multiplies by the routing weight.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightserve.config import KernelBackend
from lightserve.kernels.activation import (
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from lightserve.kernels.backend import runs_triton
from lightserve.kernels.linear import PackedLinear, PrepackedLinear, linear
from lightserve.kernels.prefill_attention import dot_precision

ExpertLinear = Tensor | PackedLinear | PrepackedLinear


# ---- routing -------------------------------------------------------------------------------------------------------

def topk_softmax(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Mixtral (renormalize=True) and Qwen3-MoE (renormalize=norm_topk_prob): softmax over the experts in float32,
    the top_k largest, optionally divided by their sum. router_logits [T, E] -> weights [T, k] float32, expert ids
    [T, k] int64, largest first (HF's MixtralTopKRouter / Qwen3MoeTopKRouter)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk_sigmoid(
    router_logits: Tensor, correction_bias: Tensor, top_k: int, num_groups: int, topk_groups: int,
    renormalize: bool, scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 (HF DeepseekV3TopkRouter, op for op): sigmoid scores; the choice uses scores + correction_bias,
    limited to the topk_groups groups (of E / num_groups experts) whose two best biased scores sum highest; the
    weights are the unbiased scores of the chosen experts, divided by their sum (+1e-20) when renormalize, times
    scaling_factor. router_logits [T, E] float32, correction_bias [E] -> weights [T, k] float32, ids [T, k] int64."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()  # [T, E]
    biased = scores + correction_bias  # [T, E], for the choice only
    group_scores = biased.view(num_tokens, num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, num_experts // num_groups).reshape(num_tokens, -1)
    biased = biased.masked_fill(~expert_mask.bool(), float("-inf"))  # [T, E]
    ids = torch.topk(biased, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling_factor, ids


# ---- expert weights ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one MoE layer, one TP rank's share of each expert's intermediate dim (I = I_full / tp).

    gate_up: [E, 2I, H], the gate rows then the up rows of each expert (HF 5's `experts.gate_up_proj`);
    down: [E, H, I] (`experts.down_proj`). On CPU `pack_expert_weights` replaces both with one weight per expert in
    the layout kernels.linear runs fastest; indexing `[e]` gives expert e's weight either way."""

    gate_up: Tensor | tuple[ExpertLinear, ...]
    down: Tensor | tuple[ExpertLinear, ...]

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def pack_expert_weights(weights: ExpertWeights, pack: Callable[[Tensor], ExpertLinear]) -> ExpertWeights:
    """One packed weight per expert (`kernels.pack_linear_weight` for float32, `prepack_weight` for bf16);
    the stacked tensors are not kept."""
    assert isinstance(weights.gate_up, Tensor) and isinstance(weights.down, Tensor), "already packed"
    return replace(weights, gate_up=tuple(pack(w) for w in weights.gate_up.unbind(0)),
                   down=tuple(pack(w) for w in weights.down.unbind(0)))


def intermediate_shard(intermediate_size: int, tp_rank: int, tp_size: int) -> slice:
    """The rows of one expert's gate_proj / up_proj (and columns of its down_proj) that rank tp_rank holds.
    Raises ValueError when the size does not split evenly."""
    if intermediate_size % tp_size:
        raise ValueError(f"moe_intermediate_size {intermediate_size} is not a multiple of --tp {tp_size}")
    per_rank = intermediate_size // tp_size
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def shard_expert_weights(gate_up: Tensor, down: Tensor, tp_rank: int, tp_size: int) -> ExpertWeights:
    """gate_up [E, 2I, H], down [E, H, I] of the full experts -> rank tp_rank's ExpertWeights: gate and up rows and
    down columns of its intermediate slice, so each rank's output is a partial sum that an all-reduce completes,
    exactly as for the dense MLP. Copies, so the full tensors can be freed."""
    inter = down.shape[2]
    cols = intermediate_shard(inter, tp_rank, tp_size)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]  # [E, I, H] each
    local = torch.cat([gate[:, cols], up[:, cols]], dim=1).contiguous()  # [E, 2I/tp, H]
    return ExpertWeights(local, down[:, :, cols].contiguous())  # down: [E, H, I/tp]


# ---- experts -------------------------------------------------------------------------------------------------------

def fused_experts_ref(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """HF's MixtralExperts.forward: for each expert hit, silu(gate) * up then down over its tokens, times the
    routing weight (in the weight's dtype), added into a zero output in x.dtype. x [T, H] -> [T, H]."""
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token_idx, pos = torch.where(topk_ids == expert)
        h = torch.nn.functional.linear(x[token_idx], weights.gate_up[expert])  # [n, 2I]
        y = torch.nn.functional.linear(silu_and_mul_ref(h), weights.down[expert])  # [n, H]
        y = y * topk_weights[token_idx, pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def fused_experts_cpu(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """The grouped CPU path: x [T, H] -> [T, H]. The loop runs over active experts, each one GEMM of its rows."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)  # [T*k], pair p = token p // k
    order = torch.argsort(flat_ids, stable=True)  # [T*k], pairs grouped by expert, ascending
    counts = torch.bincount(flat_ids, minlength=weights.num_experts).tolist()
    token_of = order // top_k  # [T*k] token of each sorted pair
    xs = x.index_select(0, token_of)  # [T*k, H], each expert's rows contiguous
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = linear(xs[start:start + n], weights.gate_up[expert])  # [n, 2I]
        ys[start:start + n] = linear(silu_and_mul(gate_up), weights.down[expert])  # [n, H]
        start += n
    ys = (ys * topk_weights.reshape(-1)[order, None]).to(x.dtype)  # [T*k, H]
    # Pairs of one token meet in ascending expert order, the order HF's per-expert index_add_ adds them.
    return torch.zeros_like(x).index_add_(0, token_of, ys)


def moe_align_block_size(topk_ids: Tensor, block_m: int, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Lay the T*k (token, k) pairs out by expert, each expert's run padded to a multiple of block_m, so every
    block of block_m rows belongs to one expert. Device ops only: no host sync, sizes are upper bounds.

    Returns sorted_pairs [P] int32 (pair index p = token * k + j; T*k marks padding), block_experts [P / block_m]
    int32 (the expert of each block; blocks past the end are unused) and num_padded [1] int32 (rows used)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    # At most min(E, T*k) experts are active, each wasting at most block_m - 1 rows of padding.
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    # NOTE: scatter_add_, not bincount: CUDA's bincount reads the max back to the host (no graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [T*k]
    sorted_e = flat[order]  # [T*k]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (padded_end - padded)[sorted_e] + rank  # [T*k] row of each sorted pair
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)  # [P / block_m]
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


# num_pairs (T*k) changes every step: specialized on like other ints (== 1, % 16 == 0), it would compile a new
# variant mid-serving whenever the batch's pair count crossed a residue the warm-up did not launch.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    N, K, num_pairs, a_stride, w_stride_e, w_stride_n, out_stride,
    TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    # out[pair, :] = a[pair // TOP_K, :] @ w[expert]^T (x routing weight): one BLOCK_M x BLOCK_N tile of one expert.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)  # [BLOCK_M]; int64 offsets below
    m_mask = pairs < num_pairs  # padding rows hold num_pairs
    rows = pairs // TOP_K  # row of a: the token (TOP_K = k) or the pair itself (TOP_K = 1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * w_stride_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(a_ptr + rows[:, None] * a_stride + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_base + offs_n[None, :] * w_stride_n + kk[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * out_stride + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fused_experts_triton(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor,
                         block_m: int | None = None) -> Tensor:
    """x [T, H] -> [T, H] with two grouped GEMMs over every expert and the existing SiLU-and-mul between them."""
    gate_up, down = weights.gate_up, weights.down
    assert isinstance(gate_up, Tensor) and isinstance(down, Tensor), "the Triton path takes stacked weights"
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    assert gate_up.shape == (num_experts, two_inter, hidden) and down.shape == (num_experts, hidden, two_inter // 2)
    assert x.dtype == gate_up.dtype == down.dtype and x.stride(1) == 1, (x.dtype, gate_up.dtype, x.stride())
    assert gate_up.stride(2) == 1 and down.stride(2) == 1, "expert rows must be contiguous"
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k), (topk_weights.shape, topk_ids.shape)
    if num_tokens == 0:
        return torch.empty_like(x)
    num_pairs = num_tokens * top_k
    if block_m is None:  # decode-sized steps: small blocks waste less padding per expert
        block_m = 16 if num_pairs <= 4 * num_experts else 64
    sorted_pairs, block_experts, num_padded = moe_align_block_size(topk_ids, block_m, num_experts)
    route_w = topk_weights.contiguous().view(-1)  # [T*k], any float dtype
    h = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)  # [T*k, 2I]
    _launch_grouped_gemm(x, gate_up, h, route_w, sorted_pairs, block_experts, num_padded, top_k, False, block_m)
    act = silu_and_mul_triton(h)  # [T*k, I]
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T*k, H], weighted
    _launch_grouped_gemm(act, down, y, route_w, sorted_pairs, block_experts, num_padded, 1, True, block_m)
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_experts(x: Tensor, weights: ExpertWeights, topk_weights: Tensor, topk_ids: Tensor,
                  backend: KernelBackend | None = None) -> Tensor:
    """x [T, H], topk_weights [T, k] (float32, or x.dtype for Qwen3-MoE), topk_ids [T, k] int64 -> [T, H]:
    sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])."""
    if runs_triton(x, backend):
        return fused_experts_triton(x, weights, topk_weights, topk_ids)
    return fused_experts_cpu(x, weights, topk_weights, topk_ids)


def warm_up_fused_experts(x: Tensor, weights: ExpertWeights, top_k: int,
                          route_dtype: torch.dtype = torch.float32) -> None:
    """Compile the grouped GEMM for both block sizes fused_experts_triton picks, with the model's dtype and shapes
    (x [T, H], any T >= 1) and the routing weights' dtype (float32; Qwen3-MoE's are x.dtype). The outputs are
    discarded. Every other argument's key is the same at any T (num_pairs is not specialized on)."""
    ids = torch.arange(top_k, device=x.device).remainder(weights.num_experts).expand(x.shape[0], top_k)
    route_w = torch.full(ids.shape, 1.0 / top_k, dtype=route_dtype, device=x.device)
    for block_m in (16, 64):
        fused_experts_triton(x, weights, route_w, ids.contiguous(), block_m=block_m)


def _launch_grouped_gemm(a: Tensor, w: Tensor, out: Tensor, route_w: Tensor, sorted_pairs: Tensor,
                         block_experts: Tensor, num_padded: Tensor, top_k: int, mul_weight: bool,
                         block_m: int) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (sorted_pairs.shape[0] // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, route_w, sorted_pairs, block_experts, num_padded,
        n, k, out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(a.dtype), num_warps=4,
    )
