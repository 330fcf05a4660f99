"""HF checkpoints whose linear weights are quantized to int8 or 4 bits (compressed-tensors, AWQ, GPTQ), served with the
weights kept packed. `quant_scheme` reads config.json's quantization_config (through models.config_from_dict, at
launch: ValueError naming what is not served); HFQuantReader, the weights.CheckpointReader of such a folder, gives each
quantized linear as a QuantLinear repacked once at load into quant_linear's Q8_0F / Q4_1F blocks (a scale, and an
offset o = -scale * zero, per 32 input columns), so each value is the checkpoint's float32 scale * (q - zero).

The layouts (as vLLM's and compressed-tensors' loaders read them), a weight being [N, K] = [out, in]:
  compressed-tensors int-quantized  weight int8 [N, K], weight_scale [N, K / group] (group = K: per channel)
  compressed-tensors pack-quantized weight_packed int32 [N, K * bits / 32], value i of a word at bits * i, stored
                                    with 2^(bits - 1) added; weight_shape [2]
  AWQ (GEMM)   qweight int32 [K, N / 8], the 8 nibbles of a word hold columns 0, 2, 4, 6, 1, 3, 5, 7; qzeros int32
               [K / group, N / 8] in the same order; scales [K / group, N]
  GPTQ         qweight int32 [K * bits / 32, N], value i of a word is row 32 / bits * word + i; qzeros int32
               [groups, N * bits / 32] in order (format "gptq" stores zero - 1; "gptq_v2" the zero; a symmetric
               checkpoint's zero is 2^(bits - 1) whatever it stores); scales [groups, N]; g_idx [K], the group of each
               input column (act-order, desc_act: any order).
Columns of one 32-block must share a group: group sizes are multiples of 32, and an act-order weight's columns are
sorted by group (QuantLinear.in_perm keeps the order).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightserve.kernels.quant_linear import (
    GGMLType,
    QuantLinear,
    QuantSegment,
    dequantize,
    pack_q4_1f,
    pack_q8_0f,
)
from lightserve.model_infer.weights import CheckpointReader, cat_weights

METHODS = ("compressed-tensors", "awq", "gptq")
CT_FORMATS = ("int-quantized", "pack-quantized", "naive-quantized")
BLOCK = 32  # input columns of one Q8_0F / Q4_1F block: one scale each
_AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ's nibble i of a word holds column _AWQ_ORDER[i]; this undoes it


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's quantization_config says about its linear weights (carried as ModelConfig.quantization)."""

    method: str                     # one of METHODS
    bits: int                       # 8 or 4
    group_size: int                 # input columns sharing a scale; -1: the whole row (per channel)
    symmetric: bool
    act_order: bool = False         # GPTQ desc_act / compressed-tensors actorder "group": g_idx may reorder groups
    zero_offset: int = 0            # added to a stored zero point (GPTQ's format "gptq" stores zero - 1)
    int8_activations: bool = False  # W8A8: dynamic per-token int8 activations asked for; served in float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantScheme:
        return cls(**json.loads(text))


def quant_scheme(quantization: object) -> QuantScheme:
    """The scheme of a config.json quantization_config; ValueError naming the method, format, bit width, strategy or
    key that is not served."""
    if not isinstance(quantization, dict):
        raise ValueError(f"quantization_config {quantization!r} is not supported")
    method = str(quantization.get("quant_method", "?")).lower()
    if method == "gptq":
        return _gptq_scheme(quantization)
    if method == "awq":
        return _awq_scheme(quantization)
    if method == "compressed-tensors":
        return _ct_scheme(quantization)
    raise ValueError(f"quantization_config quant_method {method!r} is not supported (served: compressed-tensors "
                     "int8 / int4, awq, gptq)")


class HFQuantReader(CheckpointReader):
    """The folder's safetensors, where `full`/`rows`/`cols` of a quantized linear's `<module>.weight` give a
    QuantLinear (repacked from `<module>.qweight`, `.weight_packed`, or an int8 `.weight` with its `.weight_scale`;
    full(name, dtype) dequantizes it instead) and of anything else the tensor, as weights.CheckpointReader gives it.
    CPU only (the quantized kernels run in C)."""

    def __init__(self, model_dir: Path, scheme: QuantScheme, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{scheme.method} weights are served on CPU only (quantized linears run in C), not on "
                             f"{device}")
        super().__init__(model_dir, dtype, device)
        self.scheme = scheme

    def has(self, name: str) -> bool:
        return super().has(name) or self._stored_as(name) is not None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has(name)

    def full(self, name: str, dtype: torch.dtype | None = None) -> Tensor | QuantLinear:
        if self._stored_as(name) is None:
            return super().full(name, dtype)
        w = _pack(*self._unpacked(name), self.scheme.bits, name)
        return w if dtype is None else dequantize(w).to(device=self.device, dtype=dtype)

    def rows(self, name: str, start: int, end: int) -> Tensor | QuantLinear:
        if self._stored_as(name) is None:
            return super().rows(name, start, end)
        q, scale, zero, group = self._unpacked(name)
        # Quant rows and their scales are the same output features: slicing before packing packs only this rank's.
        return _pack(q[start:end], scale[start:end], None if zero is None else zero[start:end], group,
                     self.scheme.bits, name)

    def row_ranges(self, name: str, ranges: list[tuple[int, int]]) -> Tensor | QuantLinear:
        return cat_weights([self.rows(name, a, b) for a, b in ranges])

    def cols(self, name: str, start: int, end: int) -> Tensor | QuantLinear:
        if self._stored_as(name) is None:
            return super().cols(name, start, end)
        q, scale, zero, group = self._unpacked(name)
        return _pack(q[:, start:end], scale, zero, group[start:end], self.scheme.bits, name)

    # ---- private ----

    def _stored_as(self, name: str) -> str | None:
        """How the linear weight `name` is stored quantized ("qweight", "weight_packed", "int8"), or None."""
        if not name.endswith(".weight"):
            return None
        base = name[: -len(".weight")]
        if super().has(base + ".qweight"):
            return "qweight"
        if super().has(base + ".weight_packed"):
            return "weight_packed"
        if super().has(base + ".weight_scale") and super().has(name):
            return "int8"
        return None

    def _unpacked(self, name: str) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """(q [N, K] int32, scale [N, G] float32, zero [N, G] int32 or None, group [K] int64: each column's scale
        column), the weight's values being scale[n, group[k]] * (q[n, k] - zero[n, group[k]]); for 4 bits q is
        unsigned and zero is given, for 8 bits zero is None or leaves q - zero in int8's range."""
        base, sc, bits = name[: -len(".weight")], self.scheme, self.scheme.bits
        half = 1 << (bits - 1)
        stored = self._stored_as(name)
        if stored == "qweight":
            qweight, scale = self[base + ".qweight"], self[base + ".scales"].float().T.contiguous()  # [N, G]
            n, groups = scale.shape
            if sc.method == "awq":  # qweight [K, N / 8], qzeros [G, N / 8], both in AWQ's column order
                q = _unpack_last(qweight, bits)[:, :, list(_AWQ_REVERSE)].reshape(qweight.shape[0], n).T
                zero = _unpack_last(self[base + ".qzeros"], bits)[:, :, list(_AWQ_REVERSE)].reshape(groups, n).T
            else:  # GPTQ: qweight [K * bits / 32, N], qzeros [G, N * bits / 32]
                q = _unpack_last(qweight.T, bits).reshape(n, -1)
                zero = torch.full((n, groups), half, dtype=torch.int32) if sc.symmetric else \
                    _unpack_last(self[base + ".qzeros"], bits).reshape(groups, n).T + sc.zero_offset
            g_idx = base + ".g_idx"
        else:  # compressed-tensors: values signed, stored + 2^(bits - 1) when packed
            if stored == "weight_packed":  # [N, K * bits / 32]
                n, k = (int(v) for v in self[base + ".weight_shape"].reshape(-1))
                q = _unpack_last(self[base + ".weight_packed"], bits).reshape(n, -1)[:, :k] - half
            else:  # int8 [N, K]
                q = self[name].to(torch.int32)
                n = q.shape[0]
            raw = self[base + ".weight_scale"].float()
            scale = raw.reshape(1, 1).expand(n, 1) if raw.numel() == 1 else raw.reshape(n, -1)  # per tensor: [N, 1]
            zero = None
            if bits == 4:  # unsigned quants about a zero of 8
                q, zero = q + half, torch.full(scale.shape, half, dtype=torch.int32)
            g_idx = base + ".weight_g_idx"
        k = q.shape[1]
        if super().has(g_idx):
            group = self[g_idx].long()
        else:
            group = torch.arange(k) // (k if scale.shape[1] == 1 else sc.group_size)
        return q.contiguous(), scale.contiguous(), None if zero is None else zero.contiguous(), group


def _pack(q: Tensor, scale: Tensor, zero: Tensor | None, group: Tensor, bits: int, name: str) -> QuantLinear:
    """The QuantLinear of q [N, K] (see HFQuantReader._unpacked): one Q8_0F or Q4_1F block per 32 columns, the
    columns sorted by group first when a block would otherwise mix groups (act-order). ValueError naming the tensor
    when K is not whole blocks, a group is not, or int8 quants minus their zero leave int8's range."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"{name}: {k} input columns are not whole blocks of {BLOCK}")
    perm = None
    if not _one_group_per_block(group):
        perm = torch.argsort(group, stable=True)
        q, group = q[:, perm], group[perm]
        if not _one_group_per_block(group):
            raise ValueError(f"{name}: its quantization groups are not whole blocks of {BLOCK} input columns")
    block_group = group[::BLOCK]  # [K / 32]
    s = scale[:, block_group]  # [N, K / 32] float32
    try:
        if bits == 8:
            d = q if zero is None else q - zero[:, block_group].repeat_interleave(BLOCK, dim=1)
            seg = QuantSegment(GGMLType.Q8_0F, pack_q8_0f(d, s))
        else:
            seg = QuantSegment(GGMLType.Q4_1F, pack_q4_1f(q, s, -(s * zero[:, block_group].float())))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return QuantLinear((seg,), k, perm)


def _one_group_per_block(group: Tensor) -> bool:
    blocks = group.reshape(-1, BLOCK)
    return bool((blocks == blocks[:, :1]).all())


def _unpack_last(words: Tensor, bits: int) -> Tensor:
    """int32 [..., W] -> [..., W, 32 / bits] int32: value i of each word at bits * i, unsigned."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _check_group(method: str, group_size: int) -> None:
    if group_size != -1 and (group_size <= 0 or group_size % BLOCK):
        raise ValueError(f"{method} group_size {group_size} is not supported (-1 or a multiple of {BLOCK})")


def _gptq_scheme(cfg: dict) -> QuantScheme:
    bits, group, sym = int(cfg.get("bits", 0)), int(cfg.get("group_size", -1)), bool(cfg.get("sym", True))
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    if bits not in (4, 8) or (bits == 8 and not sym):
        raise ValueError(f"gptq bits={bits}{'' if sym else ' asymmetric'} is not supported (4 bits, or 8 symmetric)")
    _check_group("gptq", group)
    if cfg.get("dynamic"):
        raise ValueError("gptq per-module overrides (dynamic) are not supported")
    return QuantScheme("gptq", bits, group, sym, act_order=bool(cfg.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0)


def _awq_scheme(cfg: dict) -> QuantScheme:
    bits, group = int(cfg.get("bits", cfg.get("w_bit", 0))), int(cfg.get("group_size", cfg.get("q_group_size", -1)))
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq version {version!r} is not supported (gemm)")
    if bits != 4:
        raise ValueError(f"awq bits={bits} is not supported (4)")
    if not cfg.get("zero_point", True):
        raise ValueError("awq without zero points (zero_point=false) is not supported")
    _check_group("awq", group)
    return QuantScheme("awq", 4, group, False)


def _ct_scheme(cfg: dict) -> QuantScheme:
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors without config_groups is not supported")
    if cfg.get("sparsity_config") and (cfg["sparsity_config"].get("format") or "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity ({cfg['sparsity_config'].get('format')}) is not supported")
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":  # "frozen" and earlier ones store float weights beside their scales
        raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported (compressed)")
    if cfg.get("transform_config"):
        raise ValueError("compressed-tensors transforms (transform_config) are not supported")
    schemes = {_ct_group_scheme(name, group, cfg.get("format")) for name, group in groups.items()}
    if len(schemes) > 1:
        raise ValueError("compressed-tensors config groups with different schemes are not supported")
    return schemes.pop()


def _ct_group_scheme(name: str, group: dict, top_format: str | None) -> QuantScheme:
    fmt = group.get("format") or top_format
    if fmt not in CT_FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported ({', '.join(CT_FORMATS)})")
    w = group.get("weights") or {}
    bits, kind, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy", "tensor")
    if kind != "int":
        raise ValueError(f"compressed-tensors {name}: {kind} weights are not supported (int)")
    if bits not in (8, 4) or (bits == 4 and fmt != "pack-quantized"):
        raise ValueError(f"compressed-tensors {name}: {bits}-bit weights in {fmt} are not supported (int8, or int4 "
                         "pack-quantized)")
    if not w.get("symmetric", True):
        raise ValueError(f"compressed-tensors {name}: asymmetric weights are not supported")
    if strategy not in ("channel", "group", "tensor") or w.get("dynamic"):
        raise ValueError(f"compressed-tensors {name}: weight strategy {strategy!r} is not supported "
                         "(channel, group, tensor)")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    _check_group(f"compressed-tensors {name}", group_size)
    acts = group.get("input_activations")
    if acts is not None:
        if acts.get("type", "int") != "int" or int(acts.get("num_bits", 0)) != 8 or not acts.get("dynamic", False) \
                or acts.get("strategy", "token") not in ("token", "tensor"):
            raise ValueError(f"compressed-tensors {name}: input activations {acts.get('type')}"
                             f"{acts.get('num_bits')} {acts.get('strategy')} "
                             f"{'dynamic' if acts.get('dynamic') else 'static'} are not supported (dynamic int8)")
    if group.get("output_activations") is not None:
        raise ValueError(f"compressed-tensors {name}: quantized output activations are not supported")
    return QuantScheme("compressed-tensors", bits, group_size, True, act_order=w.get("actorder") == "group",
                       int8_activations=acts is not None)
