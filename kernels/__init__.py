"""Kernels of the model's forward pass: a torch reference (the spec and the CPU path) and a Triton kernel per op.

Each dispatch function runs Triton when its input is on CUDA and, otherwise, a C kernel where one exists
(kernels/cpu/: decode attention, the float32 linear) or the reference."""
from lightserve.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref
from lightserve.kernels.decode_attention import decode_attention, decode_attention_ref
from lightserve.kernels.kv_store import store_kv, store_kv_ref
from lightserve.kernels.linear import (
    OneDNNLinear,
    PackedLinear,
    linear,
    linear_ref,
    onednn_available,
    pack_linear_weight,
    prepack_onednn_weight,
)
from lightserve.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_ref,
)
from lightserve.kernels.rmsnorm import (
    add_rmsnorm,
    add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from lightserve.kernels.rotary import rotary_emb, rotary_emb_ref

__all__ = [
    "OneDNNLinear", "PackedLinear", "add_rmsnorm", "gelu_tanh_and_mul", "gelu_tanh_and_mul_ref", "add_rmsnorm_ref", "decode_attention", "decode_attention_ref", "linear",
    "linear_ref", "onednn_available", "pack_linear_weight", "prefill_attention", "prepack_onednn_weight",
    "prefill_attention_ref", "rmsnorm", "rmsnorm_ref", "rotary_emb", "rotary_emb_ref", "silu_and_mul",
    "silu_and_mul_ref", "store_kv", "store_kv_ref",
]
