"""rotary_emb: the reference against HF's apply_rotary_pos_emb written out, the Triton and C kernels against the
reference, on strided q/k views of a fused qkv output; with the Walsh-Hadamard transform an 8-bit KV cache asks for
too (`hadamard=True`)."""
import pytest
import torch

from lightserve.kernels.cpu import library, variant_library
from lightserve.kernels.rotary import (
    hadamard_block,
    hadamard_ref,
    rotary_emb,
    rotary_emb_cpu,
    rotary_emb_ref,
    rotary_emb_triton,
)
from tests.kernels.kernel_cases import DEVICE, TOL, c_library_variants

BASE = 100000.0  # SmolLM2's rope_theta


def _cos_sin(head_dim, max_pos):
    inv_freq = 1.0 / (BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=DEVICE) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float, device=DEVICE)[:, None] * inv_freq  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1), inv_freq  # [max_pos, D]


def _hf_rotary(x, positions, inv_freq):
    # transformers' LlamaRotaryEmbedding.forward + apply_rotary_pos_emb, written out for x [T, H, D].
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    rotate_half = torch.cat((-x2, x1), dim=-1)
    return (x * cos) + (rotate_half * sin)


def _qkv_views(dtype, num_tokens, num_q_heads, num_kv_heads, head_dim):
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].view(num_tokens, num_q_heads, head_dim)  # strided views, as the model passes them
    k = qkv[:, q_width:q_width + kv_width].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", TOL)
def test_reference_is_hf_rotary_bit_for_bit(dtype):
    cos_sin, inv_freq = _cos_sin(64, 300)
    qkv, q, k = _qkv_views(dtype, 6, 3, 1, 64)
    positions = torch.tensor([0, 1, 7, 64, 200, 299], device=DEVICE)
    expect_q, expect_k = _hf_rotary(q, positions, inv_freq), _hf_rotary(k, positions, inv_freq)
    v_before = qkv[:, 4 * 64:].clone()
    rotary_emb_ref(q, k, positions, cos_sin)
    assert torch.equal(q, expect_q) and torch.equal(k, expect_k)
    assert torch.equal(qkv[:, 4 * 64:], v_before)  # the v slice of the fused output is untouched


# head_dim 80 and 96 (Phi-2-like, some Qwen2 sizes): half-widths 40 and 48 are padded to 64 with masked lanes.
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim",
                         [(4, 4, 64), (8, 2, 128), (9, 3, 64), (20, 1, 64), (4, 2, 80), (3, 1, 96)])
@pytest.mark.parametrize("dtype", TOL)
def test_rotary_triton_matches_reference(num_q_heads, num_kv_heads, head_dim, dtype):
    cos_sin, _ = _cos_sin(head_dim, 500)
    qkv, q, k = _qkv_views(dtype, 5, num_q_heads, num_kv_heads, head_dim)
    positions = torch.randint(0, 500, (5,), device=DEVICE)
    qkv_ref = qkv.clone()
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    q_ref = qkv_ref[:, :q_width].view(q.shape)
    k_ref = qkv_ref[:, q_width:q_width + kv_width].view(k.shape)
    rotary_emb_triton(q, k, positions, cos_sin)
    rotary_emb_ref(q_ref, k_ref, positions, cos_sin)
    # The kernel rounds once from fp32 where HF rounds per op, so bf16/fp16 differ by about one ulp.
    torch.testing.assert_close(qkv, qkv_ref, **TOL[dtype])


def _sylvester(block: int, head_dim: int) -> torch.Tensor:
    """The block-diagonal normalized Walsh-Hadamard matrix [D, D] in float64, built by Sylvester's doubling."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return torch.block_diag(*[h / block ** 0.5] * (head_dim // block))


@pytest.mark.parametrize("head_dim, block", [(16, 16), (24, 8), (64, 64), (96, 32), (128, 64), (512, 64)])
def test_hadamard_reference_is_the_walsh_matrix_and_keeps_dot_products(head_dim, block):
    assert hadamard_block(head_dim) == block
    x, y = torch.randn(2, 10, head_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    hx, hy = hadamard_ref(x.float()).double(), hadamard_ref(y.float()).double()
    torch.testing.assert_close(hx, x @ _sylvester(block, head_dim), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((hx * hy).sum(-1), (x * y).sum(-1), atol=1e-4, rtol=1e-5)  # q . k unchanged


def test_hadamard_evens_out_a_large_channel():
    """What it is for: one channel 20x the others (SmolLM2's keys) sets an int8 row's scale; after the transform the
    row's largest entry is near its typical one, so int8's rounding error relative to the row's norm falls."""
    from lightserve.kernels.kv_store import dequantize_kv, quantize_kv_ref

    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    x[:, 5] *= 20

    def int8_error(rows):
        q, scale = quantize_kv_ref(rows[:, None], torch.int8)
        return ((dequantize_kv(q, scale)[:, 0] - rows).norm(dim=-1) / rows.norm(dim=-1)).mean().item()

    plain, mixed = int8_error(x), int8_error(hadamard_ref(x))
    assert mixed < plain / 2, (plain, mixed)  # measured 0.0138 -> 0.0046


# 64, 96, 16: blocks across the halves (the kernel's four products of halves); 128, 256: whole blocks in each half
# (its reshape into rows of blocks); 20 q heads: two blocks of heads.
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim",
                         [(9, 3, 64), (3, 1, 96), (4, 2, 16), (20, 2, 128), (2, 1, 256)])
@pytest.mark.parametrize("dtype", TOL)
def test_rotary_triton_with_hadamard_matches_reference(num_q_heads, num_kv_heads, head_dim, dtype):
    """The kernel multiplies by the Walsh-Hadamard blocks with tl.dot (float32, ieee) where the reference runs
    butterflies, and rounds once where the reference rounds after the rotary too: an ulp or two in bf16 / fp16."""
    cos_sin, _ = _cos_sin(head_dim, 500)
    qkv, q, k = _qkv_views(dtype, 5, num_q_heads, num_kv_heads, head_dim)
    positions = torch.randint(0, 500, (5,), device=DEVICE)
    qkv_ref = qkv.clone()
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    rotary_emb_triton(q, k, positions, cos_sin, hadamard=True)
    rotary_emb_ref(qkv_ref[:, :q_width].view(q.shape), qkv_ref[:, q_width:q_width + kv_width].view(k.shape),
                   positions, cos_sin, hadamard=True)
    tol = {key: 2 * value for key, value in TOL[dtype].items()}
    torch.testing.assert_close(qkv, qkv_ref, **tol)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a device assert ends the CUDA context: checked in the interpreter")
def test_rotary_triton_asserts_the_table_bound_in_debug_mode(monkeypatch):
    # The kernel's guard on pos < max_pos is compiled in only with Triton's debug mode (TRITON_DEBUG=1 on a GPU), so
    # serving pays nothing for it; the interpreter builds with its builder's options, switched to debug here.
    import dataclasses

    from triton.runtime import interpreter

    cos_sin, _ = _cos_sin(64, 16)
    _, q, k = _qkv_views(torch.float32, 3, 2, 1, 64)
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    rotary_emb_triton(q, k, torch.tensor([0, 15, 3]), cos_sin)
    with pytest.raises(Exception, match="position outside the cos/sin table"):
        rotary_emb_triton(q, k, torch.tensor([0, 15, 16]), cos_sin)


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
@pytest.mark.parametrize("variant", c_library_variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 300])  # 300 x 12 heads x 64: past the threshold for both threads
# 24: shorter than a vector; 320: past the bf16 array path's largest head (ROT_MAX_HALF), the per-element loop
@pytest.mark.parametrize("head_dim", [64, 24, 320])
@pytest.mark.parametrize("hadamard", [False, True])  # Walsh-Hadamard blocks of 64, 8 and 64
def test_cpu_kernel_is_the_reference_bit_for_bit(num_tokens, head_dim, dtype, variant, hadamard):
    """Every build this CPU runs, in both dtypes: bfloat16 rounds cos, sin, each product and each sum as
    HF's bf16 ops do, so the result is exact there too; the Walsh-Hadamard butterflies run in the reference's order."""
    lib = variant_library(variant)
    cos_sin, _ = _cos_sin(head_dim, 4096)
    qkv, q, k = _qkv_views(dtype, num_tokens, 9, 3, head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(0))
    qkv_ref = qkv.clone()
    q_ref = qkv_ref[:, :9 * head_dim].view(q.shape)
    k_ref = qkv_ref[:, 9 * head_dim:12 * head_dim].view(k.shape)
    assert rotary_emb_cpu(q, k, positions.to(torch.int32), cos_sin, lib=lib, hadamard=hadamard)
    rotary_emb_ref(q_ref, k_ref, positions, cos_sin, hadamard)
    assert torch.equal(qkv, qkv_ref)  # exact: the same roundings, and v untouched


@pytest.mark.skipif(DEVICE.type != "cpu" or library() is None, reason="the C kernel is the CPU path")
def test_cpu_kernel_declines_float16_and_the_dispatch_falls_back():
    cos_sin, _ = _cos_sin(64, 100)
    qkv, q, k = _qkv_views(torch.float16, 4, 3, 1, 64)
    positions = torch.tensor([0, 5, 50, 99])
    assert not rotary_emb_cpu(q, k, positions, cos_sin)
    qkv_ref = qkv.clone()
    rotary_emb(q, k, positions, cos_sin)
    rotary_emb_ref(qkv_ref[:, :3 * 64].view(q.shape), qkv_ref[:, 3 * 64:4 * 64].view(k.shape), positions, cos_sin)
    assert torch.equal(qkv, qkv_ref)
