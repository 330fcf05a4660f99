"""A Llama-family model's decoder layers in one C call on CPU (kernels/cpu/decoder_layers.c).

The reference is the model's forward one kernel call at a time (model_infer/models/llama.py's layer loop): the C
driver runs the same kernels in the same order with the same arguments, so its output is bit for bit that loop's,
without the 7-9 us of Python and ctypes each of the loop's ~10 calls a layer costs. `CpuDecoderLayers.build`
returns None for a model whose layers it does not take, and `takes(tokens)` says which steps it runs; the model
runs the loop for the others. A step with LoRA segments runs here too once the model's adapters are bound
(`bind_lora`): the driver adds each projection's delta with lora.c's kernel where the loop calls it.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from lightserve.kernels.kv_store import KV_KIND, QUANT_KV_DTYPES, KVScale, c_kv_layout, c_scale_args
from lightserve.kernels.linear import PAIR_MAX_M, PackedLinear, PrepackedLinear
from lightserve.kernels.quant_linear import BLOCK_SHAPES, QuantLinear

if TYPE_CHECKING:
    from lightserve.kernels.lora import LoraSegments, Slice

    # One group's stacked LoRA weights: a [num_slots, R, K], bt [num_slots, R, N] float32 or bf16, the expand's slices.
    LoraStack = tuple[Tensor, Tensor, tuple[Slice, ...]]

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """decoder_layers.c's LayerArgs: one layer's pointers."""

    _fields_ = [("input_norm", _P), ("post_attn_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _P),
                ("qkv_bias", _P), ("o_proj", _P), ("o_bias", _P), ("gate_up", _P), ("down", _P), ("qkv_f", _P),
                ("qkv_bias_f", _P), ("o_proj_f", _P), ("o_bias_f", _P), ("gate_up_f", _P), ("down_f", _P),
                ("k_cache", _P), ("v_cache", _P), ("cos_sin", _P), ("cos_sin_row", _I64), ("window", _I32),
                ("k_scales", _P), ("v_scales", _P), ("k_scale", _F32), ("v_scale", _F32), ("qkv_q", _P),
                ("o_proj_q", _P), ("gate_up_q", _P), ("down_q", _P), ("lora", _P)]


LORA_GROUPS = 4  # decoder_layers.c's LoraGroupArgs per layer: QKV, O, GATE_UP, DOWN (model_infer/lora.py's LoraGroup)
LORA_C_DTYPES = (torch.float32, torch.bfloat16)  # of the stacks lora.c reads (LoraGroupArgs.w_bf16)


class LoraGroupArgs(ctypes.Structure):
    """decoder_layers.c's LoraGroupArgs: one layer's stacked LoRA weights of one group of projections."""

    _fields_ = [("a", _P), ("bt", _P), ("slices", _P), ("targeted", _P), ("rank", _I32), ("num_slices", _I32),
                ("w_bf16", _I32)]


class LoraStep(ctypes.Structure):
    """decoder_layers.c's LoraStep: one step's adapter segments."""

    _fields_ = [("starts", _P), ("lens", _P), ("slots", _P), ("segments", _I32), ("num_slots", _I32)]


QUANT_MAX_SEGMENTS = 4  # decoder_layers.c's: the most row segments of one projection (q | k | v types, say)


class QuantWeight(ctypes.Structure):
    """decoder_layers.c's QuantWeight: a projection kept in GGML blocks (a QuantLinear), segment by segment."""

    _fields_ = [("segments", _I32), ("int8_dot", _I32), ("qtype", _I32 * QUANT_MAX_SEGMENTS),
                ("rows", _I32 * QUANT_MAX_SEGMENTS), ("row_bytes", _I64 * QUANT_MAX_SEGMENTS),
                ("blocks", _P * QUANT_MAX_SEGMENTS)]

    @classmethod
    def of(cls, w: QuantLinear) -> QuantWeight:
        segs = w.segments
        return cls(len(segs), int(w.int8_dot), (_I32 * QUANT_MAX_SEGMENTS)(*(int(s.qtype) for s in segs)),
                   (_I32 * QUANT_MAX_SEGMENTS)(*(s.rows for s in segs)),
                   (_I64 * QUANT_MAX_SEGMENTS)(*(s.blocks.stride(0) for s in segs)),
                   (_P * QUANT_MAX_SEGMENTS)(*(s.blocks.data_ptr() for s in segs)))


class ModelDims(ctypes.Structure):
    """decoder_layers.c's ModelDims."""

    _fields_ = [("num_layers", _I32), ("hidden", _I32), ("num_heads", _I32), ("num_kv_heads", _I32),
                ("head_dim", _I32), ("inter", _I32), ("bf16", _I32), ("widened", _I32), ("eps", _F32),
                ("sm_scale", _F32), ("softcap", _F32), ("kv_rows", _I64), ("kc_row", _I64), ("vc_row", _I64),
                ("kc_head", _I64), ("vc_head", _I64), ("kv_kind", _I32)]


class StepArgs(ctypes.Structure):
    """decoder_layers.c's StepArgs: one step's batch."""

    _fields_ = [("tokens", _I32), ("num_decode", _I32), ("num_extend", _I32), ("locs_i64", _I32),
                ("positions", _P), ("kv_locs", _P), ("req_to_token", _P), ("r2t_row", _I64), ("decode_rows", _P),
                ("decode_lens", _P), ("extend_rows", _P), ("extend_q_start", _P), ("extend_prefix_lens", _P),
                ("extend_lens", _P), ("lora", _P)]


class Scratch(ctypes.Structure):
    """decoder_layers.c's Scratch: the step's buffers."""

    _fields_ = [("x", _P), ("qkv", _P), ("attn", _P), ("gate_up", _P), ("act", _P), ("q", _P), ("k", _P), ("xf", _P),
                ("yf", _P)]


def timed_labels(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernel_times() label of each of the driver's timed kernels (its T_* order): the labels the per-kernel
    wrappers use, so scripts/profile_step.py groups both forwards alike."""
    linear = "linear_bf16_cpu" if dtype == torch.bfloat16 else "linear_cpu"
    return ("rmsnorm_cpu", linear, "rotary_cpu", "store_kv_cpu", "decode_attention_cpu", "prefill_attention_cpu",
            "silu_and_mul_cpu", "lora_cpu")


@dataclass(frozen=True)
class DecoderLayer:
    """One layer's tensors as the driver reads them: norm weights and biases in the model dtype, projections
    packed for the dtype's C GEMM (or, in float32, kept in GGML blocks), the layer's rotary table and window."""

    input_norm: Tensor                                     # [H]
    post_attn_norm: Tensor                                 # [H]
    qkv: PackedLinear | PrepackedLinear | QuantLinear      # [(Hq + 2 Hk) D, H]
    qkv_bias: Tensor | None                                # [(Hq + 2 Hk) D]
    o_proj: PackedLinear | PrepackedLinear | QuantLinear   # [H, Hq D]
    o_bias: Tensor | None                                  # [H]
    gate_up: PackedLinear | PrepackedLinear | QuantLinear  # [2 I, H]
    down: PackedLinear | PrepackedLinear | QuantLinear     # [H, I]
    cos_sin: Tensor                          # [max_pos, D] float32
    window: int
    q_norm: Tensor | None = None             # [D]: Qwen3's RMSNorm over each head of q, before rotary
    k_norm: Tensor | None = None             # [D]: the same over each head of k


@dataclass(frozen=True)
class ModelShape:
    """The sizes and constants every layer shares, for this rank."""

    hidden: int
    num_heads: int      # Hq of this rank
    num_kv_heads: int   # Hk of this rank
    head_dim: int
    inter: int          # I
    eps: float
    sm_scale: float
    softcap: float


class CpuDecoderLayers:
    """Runs every decoder layer of a step in one call. Holds the layers' weight pointers; the KV cache's are
    bound on first use and again whenever the model is handed another cache."""

    def __init__(self, lib: ctypes.CDLL, layers: list[DecoderLayer], shape: ModelShape, dtype: torch.dtype,
                 max_tokens: int | None = None, widened: bool = False) -> None:
        self.lib, self.layers, self.shape, self.dtype = lib, layers, shape, dtype
        self.max_tokens = max_tokens  # the most tokens a step it runs may have; None: any number
        # bf16 GEMMs over PAIR_MAX_M rows on the weights' float32 panels, with the biases in float32 (held here)
        self.widened = widened
        self.float_biases = [(_float(layer.qkv_bias), _float(layer.o_bias)) if widened else (None, None)
                             for layer in layers]
        self.labels = timed_labels(dtype)
        # Scratch columns a token takes: x | qkv | attn | gate_up | act, then with q/k norms the normed q | k.
        sh, hd = shape, shape.head_dim
        self.widths = [sh.hidden, (sh.num_heads + 2 * sh.num_kv_heads) * hd, sh.num_heads * hd, 2 * sh.inter, sh.inter]
        if layers and layers[0].q_norm is not None:
            self.widths += [sh.num_heads * hd, sh.num_kv_heads * hd]
        # The QuantWeight descriptors of the projections kept in GGML blocks (LayerArgs points at them), per layer.
        self.quant = [{name: QuantWeight.of(w) for name, w in _projections(layer) if isinstance(w, QuantLinear)}
                      for layer in layers]
        # (k_caches, v_caches, dims, layer args) of the cache last run with: the lists are held, so `is` finds them.
        self._bound: tuple[list[Tensor], list[Tensor], ModelDims, ctypes.Array] | None = None
        # bind_lora's: the adapters' stacks and targeted table (held: C reads them), their descriptors
        # [layers * LORA_GROUPS] and slot count
        self._lora: tuple[list, np.ndarray, ctypes.Array, int] | None = None

    @classmethod
    def build(cls, layers: list[DecoderLayer], shape: ModelShape, dtype: torch.dtype,
              lib: ctypes.CDLL | None = None) -> CpuDecoderLayers | None:
        """The driver for these layers, or None where it does not take them: no C library, a dtype or weight
        layout whose per-kernel forward would not run every kernel in C (bf16 weights with no pair layout, say), or
        shapes its kernels decline.

        bf16 GEMMs run on linear.c's pair layout at every M where the build has vdpbf16ps (or AMX tiles) and no
        weight keeps a oneDNN copy or float32 panels. Where every weight has float32 panels of this build's width
        instead (CPUs without native bf16 products) the driver runs them above PAIR_MAX_M rows, as linear() does, and
        takes every step. Elsewhere (a weight that keeps oneDNN's copy: an AMX CPU whose tiles the process was not
        granted, or a K the tile GEMM does not take) the per-kernel forward runs the pairs up to PAIR_MAX_M rows and
        oneDNN above, so the driver takes the steps of up to PAIR_MAX_M tokens: the decode of one to a few requests,
        where the Python between kernels weighs most."""
        from lightserve.kernels.cpu import library

        lib = lib or library()
        if lib is None or dtype not in (torch.float32, torch.bfloat16) or not layers:
            return None
        if not all(_takes_layer(lib, layer, shape, dtype) for layer in layers):
            return None
        # q and k norms on every layer or on none (the scratch has the normed q and k or not)
        if len({layer.q_norm is None for layer in layers} | {layer.k_norm is None for layer in layers}) != 1:
            return None
        weights = [w for layer in layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        widened = dtype == torch.bfloat16 and all(
            w.onednn is None and w.widened is not None and w.widened.panel == lib.linear_panel_width() for w in weights)
        every_m = dtype == torch.float32 or widened or (bool(lib.linear_bf16_pairs_dpbf16()) and all(
            w.onednn is None and w.widened is None for w in weights))
        self = cls(lib, layers, shape, dtype, None if every_m else PAIR_MAX_M, widened)
        return self if lib.decoder_layers_supported(ctypes.byref(self.model_dims(0, (0, 0), (0, 0)))) else None

    def bind_lora(self, stacks: Sequence[Sequence[LoraStack | None]], targeted: np.ndarray) -> None:
        """Run the steps with LoRA segments on these adapters: stacks[layer][group] (LORA_GROUPS of them, in
        model_infer/lora.py's LoraGroup order) as that group's (a, bt, slices), None where no adapter can target it,
        a and bt float32 or bf16 (--lora_dtype; float16 stacks run the per-kernel forward, whose dispatch takes them);
        targeted [layers, LORA_GROUPS, num_slots] uint8, 1 where a slot's adapter targets the group in the layer.
        The store fills slots in place later (the tensors and the table keep their memory), so this binds once.
        ValueError for stacks of other shapes than the layers' projections, or of another dtype."""
        sh = self.shape
        num_layers = len(self.layers)
        num_slots = targeted.shape[-1]
        if targeted.dtype != np.uint8 or targeted.shape != (num_layers, LORA_GROUPS, num_slots) \
                or not targeted.flags.c_contiguous or len(stacks) != num_layers:
            raise ValueError(f"decoder_layers: a LoRA targeted table {targeted.shape} {targeted.dtype} or "
                             f"{len(stacks)} layers of stacks for {num_layers} layers")
        # Each group's (K, N): its projection's input and output widths.
        widths = [(sh.hidden, (sh.num_heads + 2 * sh.num_kv_heads) * sh.head_dim),
                  (sh.num_heads * sh.head_dim, sh.hidden), (sh.hidden, 2 * sh.inter), (sh.inter, sh.hidden)]
        args = (LoraGroupArgs * (num_layers * LORA_GROUPS))()
        held = []
        for layer, groups in enumerate(stacks):
            for g, stack in enumerate(groups):
                if stack is None:
                    continue
                a, bt, slices = stack
                (k, n), r = widths[g], a.shape[1]
                if not (a.dtype == bt.dtype and a.dtype in LORA_C_DTYPES and a.is_cpu and bt.is_cpu
                        and a.is_contiguous() and bt.is_contiguous() and a.shape == (num_slots, r, k)
                        and bt.shape == (num_slots, r, n)):
                    raise ValueError(f"decoder_layers: LoRA stacks of layer {layer} group {g}: a {tuple(a.shape)} "
                                     f"{a.dtype}, bt {tuple(bt.shape)} {bt.dtype}, want [{num_slots}, R, {k}] and "
                                     f"[{num_slots}, R, {n}], both float32 or both bfloat16")
                flat = [int(v) for sl in slices for v in sl]  # [num_slices, 4] (r0, rj, n0, nj)
                table = (_I32 * max(len(flat), 1))(*flat)
                num_slices = len(slices)
                held.append(table)
                targets = targeted.ctypes.data + (layer * LORA_GROUPS + g) * num_slots  # [num_slots] uint8
                args[layer * LORA_GROUPS + g] = LoraGroupArgs(a.data_ptr(), bt.data_ptr(), ctypes.addressof(table),
                                                              targets, r, num_slices, a.dtype == torch.bfloat16)
        self._lora = ([stacks, held], targeted, args, num_slots)
        self._bound = None  # the layer args point at the descriptors: built anew at the next step

    def takes(self, tokens: int) -> bool:
        """Whether run() takes a step of this many tokens (the per-kernel forward runs the others)."""
        return self.max_tokens is None or tokens <= self.max_tokens

    def run(self, residual: Tensor, k_caches: list[Tensor], v_caches: list[Tensor], req_to_token: Tensor,
            positions: Tensor, kv_locs: Tensor, num_decode: int, decode_rows: Tensor, decode_lens: Tensor,
            extend_rows: Tensor, extend_q_start: Tensor, extend_prefix_lens: Tensor, extend_lens: Tensor,
            k_scales: list[KVScale] | None = None, v_scales: list[KVScale] | None = None,
            lora: LoraSegments | None = None) -> Tensor:
        """residual [T, H]: the embeddings, updated in place into the residual stream; returns the last layer's MLP
        output [T, H] (the model's final add + RMSNorm takes both). Token order and attention metadata as the
        model's AttentionInputs: decode tokens first; extend q starts count from the first prefill token.
        k_scales / v_scales: an 8-bit cache's scales per layer (KVCache.k_scales; None: a float cache). lora: the
        step's adapter segments (batch.lora), over the adapters bind_lora bound."""
        from lightserve.kernels.cpu import active_kernel_times, profiled

        sh, es = self.shape, residual.element_size()
        tokens = residual.shape[0]
        assert residual.dtype == self.dtype and residual.is_contiguous() and residual.shape[1] == sh.hidden
        assert self.takes(tokens), (tokens, self.max_tokens)
        if tokens == 0:
            return torch.empty_like(residual)
        no_scales = [None] * len(k_caches)
        dims, layer_args = self._bind(k_caches, v_caches, k_scales or no_scales, v_scales or no_scales)
        meta = [_int32(t) for t in (decode_rows, decode_lens, extend_rows, extend_q_start, extend_prefix_lens,
                                    extend_lens)]
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() \
            else positions.to(torch.int64).contiguous()
        locs = kv_locs if kv_locs.dtype in (torch.int32, torch.int64) and kv_locs.is_contiguous() \
            else kv_locs.to(torch.int64).contiguous()
        assert req_to_token.dtype == torch.int32 and req_to_token.stride(-1) == 1
        assert pos.shape == (tokens,) and locs.shape == (tokens,)
        step = StepArgs(tokens, num_decode, meta[2].shape[0], int(locs.dtype == torch.int64), pos.data_ptr(),
                        locs.data_ptr(), req_to_token.data_ptr(), req_to_token.stride(0),
                        *(t.data_ptr() for t in meta))
        if lora is not None:
            assert self._lora is not None, "a step with LoRA segments on a driver without adapters (bind_lora)"
            segments = LoraStep(*lora.host_c_args, self._lora[3])  # alive until the call returns
            step.lora = ctypes.addressof(segments)
        scratch = torch.empty(tokens * sum(self.widths), dtype=self.dtype)  # a [T, w] block per width, back to back
        base, offsets = scratch.data_ptr(), [0]
        for w in self.widths[:-1]:
            offsets.append(offsets[-1] + tokens * w * es)
        bufs = Scratch(*(base + o for o in offsets))
        if self.widened:  # a GEMM's x and output in float32: [T, max K], then [T, max N]
            max_k = max(sh.hidden, sh.num_heads * sh.head_dim, sh.inter)
            max_n = max(self.widths[1], sh.hidden, 2 * sh.inter)
            floats = torch.empty(tokens * (max_k + max_n), dtype=torch.float32)  # alive until the call returns
            bufs.xf, bufs.yf = floats.data_ptr(), floats.data_ptr() + tokens * max_k * 4
        hidden = torch.empty(tokens, sh.hidden, dtype=self.dtype)  # [T, H]
        times = active_kernel_times()
        secs = (ctypes.c_double * len(self.labels))() if times is not None else None
        # Inside kernel_times() the driver times its kernels under their own labels; the call takes none then.
        with profiled("decoder_layers_cpu") if times is None else contextlib.nullcontext():
            rc = self.lib.decoder_layers(ctypes.byref(dims), layer_args, ctypes.byref(step), ctypes.byref(bufs),
                                         residual.data_ptr(), hidden.data_ptr(), secs, torch.get_num_threads())
        if rc != 0:
            layer, kernel = divmod(-rc - 1, len(self.labels))
            raise RuntimeError(f"decoder_layers: {self.labels[kernel]} failed at layer {layer} (a KV loc or LoRA "
                               f"segment out of range, or out of memory)")
        if times is not None:
            for label, sec in zip(self.labels, secs):
                if sec:
                    times[label] += sec
        return hidden

    def model_dims(self, kv_rows: int, k_strides: tuple[int, int], v_strides: tuple[int, int],
                   kv_dtype: torch.dtype | None = None) -> ModelDims:
        """The C side's ModelDims of these layers over a KV cache of kv_rows rows with (row, head) strides
        k_strides / v_strides (zeros: the shapes alone, as decoder_layers_supported reads them), stored as kv_dtype
        (None: the activations' dtype)."""
        sh = self.shape
        return ModelDims(len(self.layers), sh.hidden, sh.num_heads, sh.num_kv_heads, sh.head_dim, sh.inter,
                         int(self.dtype == torch.bfloat16), int(self.widened), sh.eps, sh.sm_scale, sh.softcap,
                         kv_rows, k_strides[0], v_strides[0], k_strides[1], v_strides[1],
                         KV_KIND[kv_dtype or self.dtype])

    def _bind(self, k_caches: list[Tensor], v_caches: list[Tensor], k_scales: list[KVScale],
              v_scales: list[KVScale]) -> tuple[ModelDims, ctypes.Array]:
        """The dims and layer array for this KV cache: built when the model is first handed its lists of per-layer
        tensors (a KVCache makes them once), then reused."""
        if self._bound is not None and self._bound[0] is k_caches and self._bound[1] is v_caches:
            return self._bound[2], self._bound[3]
        sh = self.shape
        k0 = k_caches[0]
        # A float cache in the activations' dtype or, under float32 ones, bf16; an 8-bit one in any format.
        cache_ok = k0.dtype in QUANT_KV_DTYPES or k0.dtype == self.dtype \
            or (self.dtype == torch.float32 and k0.dtype == torch.bfloat16)
        for k, v in zip(k_caches, v_caches, strict=True):
            if not (cache_ok and c_kv_layout(k, v) and k.dtype == v.dtype == k0.dtype
                    and k.shape == v.shape == k0.shape and k.stride() == k0.stride()
                    and k.shape[1:] == (sh.num_kv_heads, sh.head_dim)):
                raise ValueError(f"decoder_layers: a KV cache layer of another layout ({k.shape}, {k.dtype})")
        assert len(k_caches) == len(self.layers) == len(k_scales) == len(v_scales), (len(k_caches), len(self.layers))
        layer_args = (LayerArgs * len(self.layers))(*(
            _layer_args(layer, biases, k, v, c_scale_args(ks, vs), quant)
            for layer, biases, k, v, ks, vs, quant in zip(self.layers, self.float_biases, k_caches, v_caches,
                                                          k_scales, v_scales, self.quant, strict=True)))
        if self._lora is not None:  # each layer's LORA_GROUPS descriptors
            base = ctypes.addressof(self._lora[2])
            for i, args in enumerate(layer_args):
                args.lora = base + i * LORA_GROUPS * ctypes.sizeof(LoraGroupArgs)
        dims = self.model_dims(k0.shape[0], k0.stride()[:2], v_caches[0].stride()[:2], k0.dtype)
        self._bound = (k_caches, v_caches, dims, layer_args)
        return dims, layer_args


def _projections(layer: DecoderLayer) -> tuple[tuple[str, PackedLinear | PrepackedLinear | QuantLinear], ...]:
    return ("qkv", layer.qkv), ("o_proj", layer.o_proj), ("gate_up", layer.gate_up), ("down", layer.down)


def _layer_args(layer: DecoderLayer, float_biases: tuple[Tensor | None, Tensor | None], k_cache: Tensor,
                v_cache: Tensor, scale_args: tuple, quant: dict[str, QuantWeight]) -> LayerArgs:
    """scale_args: the layer's (k_scales, v_scales, k_scale, v_scale) as kv_store.c_scale_args gives them; quant: the
    descriptors of its projections kept in GGML blocks, by name (held by the caller while the driver runs)."""
    def ptr(t: Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    def qptr(name: str) -> int | None:
        return ctypes.addressof(quant[name]) if name in quant else None

    def widened(w: PackedLinear | PrepackedLinear) -> int | None:
        return w.widened.panels.data_ptr() if isinstance(w, PrepackedLinear) and w.widened is not None else None

    return LayerArgs(ptr(layer.input_norm), ptr(layer.post_attn_norm), ptr(layer.q_norm), ptr(layer.k_norm),
                     _weight_ptr(layer.qkv), ptr(layer.qkv_bias),
                     _weight_ptr(layer.o_proj), ptr(layer.o_bias), _weight_ptr(layer.gate_up), _weight_ptr(layer.down),
                     widened(layer.qkv), ptr(float_biases[0]), widened(layer.o_proj), ptr(float_biases[1]),
                     widened(layer.gate_up), widened(layer.down),
                     k_cache.data_ptr(), v_cache.data_ptr(), layer.cos_sin.data_ptr(), layer.cos_sin.stride(0),
                     layer.window, *scale_args, qptr("qkv"), qptr("o_proj"), qptr("gate_up"), qptr("down"))


def _weight_ptr(w: PackedLinear | PrepackedLinear | QuantLinear) -> int | None:
    if isinstance(w, QuantLinear):  # read through its QuantWeight descriptor
        return None
    return w.panels.data_ptr() if isinstance(w, PackedLinear) else w.pairs.data_ptr()


def _takes_layer(lib: ctypes.CDLL, layer: DecoderLayer, sh: ModelShape, dtype: torch.dtype) -> bool:
    """Whether the per-kernel forward would run every kernel of this layer in C, and with the weights the driver
    reads: float32 packed panels of this build's width, or bf16 pairs (beside a oneDNN copy or not)."""
    qkv_n = (sh.num_heads + 2 * sh.num_kv_heads) * sh.head_dim
    shapes = [(layer.qkv, qkv_n, sh.hidden), (layer.o_proj, sh.hidden, sh.num_heads * sh.head_dim),
              (layer.gate_up, 2 * sh.inter, sh.hidden), (layer.down, sh.hidden, sh.inter)]
    for w, n, k in shapes:
        if isinstance(w, QuantLinear):  # float32 activations only (the per-kernel forward widens bf16 per call), and
            # the columns in the weight's order (an act-order weight's x is gathered by quant_linear, not in C)
            ok = dtype == torch.float32 and len(w.segments) <= QUANT_MAX_SEGMENTS and w.in_perm is None \
                and all(s.qtype in BLOCK_SHAPES and s.blocks.stride(1) == 1 for s in w.segments)
        elif dtype == torch.float32:
            ok = isinstance(w, PackedLinear) and w.panel == lib.linear_panel_width()
        else:
            ok = isinstance(w, PrepackedLinear) and w.pairs is not None
        if not ok or (w.out_features, w.in_features) != (n, k):
            return False
    vectors = [(layer.input_norm, sh.hidden), (layer.post_attn_norm, sh.hidden), (layer.qkv_bias, qkv_n),
               (layer.o_bias, sh.hidden), (layer.q_norm, sh.head_dim), (layer.k_norm, sh.head_dim)]
    if not all(t is None or (t.dtype == dtype and t.is_contiguous() and t.shape == (n,)) for t, n in vectors):
        return False
    cs = layer.cos_sin
    return cs.dtype == torch.float32 and cs.dim() == 2 and cs.shape[1] == sh.head_dim and cs.stride(1) == 1 \
        and layer.input_norm is not None and layer.post_attn_norm is not None


def _float(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float()


def _int32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()

