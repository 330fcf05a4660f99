"""weights.py sharding: every rank's slices, put back together, equal the full tensors; KV heads
are replicated correctly when tp_size > num_kv_heads; impossible tp sizes are refused."""
from __future__ import annotations

import pytest
import torch

from lightserve.model_infer.models import config_from_dict, load_weights, read_model_config
from lightserve.model_infer.weights import TPShards

from .tiny_models import make_tiny_model

# SmolLM2's head counts (9 query heads, 3 kv heads), shrunk; vocab 100 is not a multiple of 3 or 9.
SHAPE = {"hidden_size": 72, "intermediate_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3,
         "vocab_size": 100}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama_bias", tmp_path_factory.mktemp("shards"), **SHAPE)


def _split_qkv(t: torch.Tensor, hq: int, hk: int, d: int):
    return t.split([hq * d, hk * d, hk * d])


def test_tp3_shards_concatenate_to_full_tensors(model_dir):
    config = read_model_config(model_dir)
    d, tp = config.head_dim, 3
    full = load_weights(model_dir, config, torch.float32)
    shards = [load_weights(model_dir, config, torch.float32, tp_rank=r, tp_size=tp) for r in range(tp)]
    for i, layer in enumerate(full.layers):
        parts = [s.layers[i] for s in shards]
        hq, hk = parts[0].qkv_proj.shape[0] // d - 2, 1
        assert (hq, hk) == (3, 1)
        for name in ("qkv_proj", "qkv_bias"):
            want = _split_qkv(getattr(layer, name), 9, 3, d)
            got = [_split_qkv(getattr(p, name), hq, hk, d) for p in parts]
            for j in range(3):  # q, k, v
                assert torch.equal(torch.cat([g[j] for g in got]), want[j])
        gate, up = layer.gate_up_proj.chunk(2)
        assert torch.equal(torch.cat([p.gate_up_proj.chunk(2)[0] for p in parts]), gate)
        assert torch.equal(torch.cat([p.gate_up_proj.chunk(2)[1] for p in parts]), up)
        assert torch.equal(torch.cat([p.o_proj for p in parts], dim=1), layer.o_proj)
        assert torch.equal(torch.cat([p.down_proj for p in parts], dim=1), layer.down_proj)
        for p in parts:  # replicated, not split
            assert torch.equal(p.input_norm, layer.input_norm) and torch.equal(p.o_bias, layer.o_bias)
    for name in ("embed", "lm_head"):
        cat = torch.cat([getattr(s, name) for s in shards])  # [3 * 34, hidden]
        assert torch.equal(cat[:100], getattr(full, name))
        assert not cat[100:].any()  # padding rows


def test_tp9_replicates_kv_heads(model_dir):
    config = read_model_config(model_dir)
    d = config.head_dim
    full = load_weights(model_dir, config, torch.float32)
    _, k_full, v_full = _split_qkv(full.layers[0].qkv_proj, 9, 3, d)
    for r in range(9):
        sh = load_weights(model_dir, config, torch.float32, tp_rank=r, tp_size=9)
        q, k, v = _split_qkv(sh.layers[0].qkv_proj, 1, 1, d)
        kv_head = r // 3  # query head r belongs to group r // (9 / 3)
        assert sh.shards.kv_head_start == kv_head
        assert torch.equal(q, full.layers[0].qkv_proj[r * d:(r + 1) * d])
        assert torch.equal(k, k_full[kv_head * d:(kv_head + 1) * d])
        assert torch.equal(v, v_full[kv_head * d:(kv_head + 1) * d])


@pytest.mark.parametrize("tp, match", [(2, "num_attention_heads"), (6, "num_attention_heads")])
def test_refuses_tp_that_does_not_divide_heads(model_dir, tp, match):
    config = read_model_config(model_dir)
    with pytest.raises(ValueError, match=match):
        TPShards.for_rank(config, 0, tp)


def test_refuses_tp_that_splits_a_kv_group():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1,
                "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 10}
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TPShards.for_rank(config_from_dict(base), 0, 2)  # 2 ranks cannot share 3 kv heads
    # 12 query heads in groups of 3 over 6 ranks: rank 1 would hold q heads 2 and 3, of kv heads 0 and 1.
    base.update(num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ValueError, match="multiple"):
        TPShards.for_rank(config_from_dict(base), 0, 6)


def test_phi3_fused_projections_are_cut_per_rank(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are one matrix each: a rank's q, k, v (and gate, up) rows are cut
    from inside it, and they equal the same rows of the unsharded load."""
    model_dir = make_tiny_model("phi3", tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    config = read_model_config(model_dir)
    d = config.head_dim
    full = load_weights(model_dir, config, torch.float32)
    shards = [load_weights(model_dir, config, torch.float32, tp_rank=r, tp_size=2) for r in range(2)]
    for i, layer in enumerate(full.layers):
        want = _split_qkv(layer.qkv_proj, 4, 2, d)
        got = [_split_qkv(s.layers[i].qkv_proj, 2, 1, d) for s in shards]
        for j in range(3):  # q, k, v
            assert torch.equal(torch.cat([g[j] for g in got]), want[j])
        gate, up = layer.gate_up_proj.chunk(2)
        assert torch.equal(torch.cat([s.layers[i].gate_up_proj.chunk(2)[0] for s in shards]), gate)
        assert torch.equal(torch.cat([s.layers[i].gate_up_proj.chunk(2)[1] for s in shards]), up)
        assert torch.equal(torch.cat([s.layers[i].down_proj for s in shards], dim=1), layer.down_proj)
