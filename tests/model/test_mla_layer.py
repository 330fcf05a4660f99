"""MLAAttention against transformers' DeepseekV3Attention on random weights: a prefill step, then a step mixing a
decode, a chunk after a cached prefix and a fresh prompt, with and without q_lora_rank, interleaved or plain rope,
default or yarn rope (mscale != mscale_all_dim, so both the cos/sin factor and the softmax scale matter)."""
import pytest
import torch

from lightserve.model_infer.forward_batch import ForwardBatch
from lightserve.model_infer.kv_cache import fill_req_to_token
from lightserve.model_infer.latent_kv_cache import LatentKVCache
from lightserve.model_infer.mla_layer import (
    MLAAttention,
    MLAConfig,
    build_mla_cos_sin,
    load_mla_weights,
)

PREFIX = "model.layers.0."
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
LENS = {0: 10, 1: 14, 2: 5}  # req_row -> full sequence length


def _hf_attention(q_lora_rank, rope_interleave, rope_parameters):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=128,
        rope_interleave=rope_interleave, rope_parameters=rope_parameters, rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"  # with an explicit causal mask below
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.uniform_(0.5, 1.5) if "layernorm" in name else p.normal_(0, p.shape[-1] ** -0.5)
    return attn, DeepseekV3RotaryEmbedding(cfg), cfg.to_dict()


def _hf_outputs(attn, rotary, xs):
    """transformers' output at every position of each full sequence."""
    out = {}
    with torch.no_grad():
        for row, x in xs.items():
            n = x.shape[0]
            cos, sin = rotary(x[None], torch.arange(n)[None])
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out[row] = attn(x[None], (cos, sin), mask)[0][0]
    return out


def _step(cache, cached, items, num_decode):
    """ForwardBatch for items = [(req_row, start, end)] (decodes first); cached[row] lists its KV rows."""
    positions, kv_locs, rows, prefix, extend, q_start = [], [], [], [], [], []
    next_loc = 1 + sum(len(v) for v in cached.values())
    for row, start, end in items:
        assert len(cached.setdefault(row, [])) == start
        q_start.append(len(positions))
        prefix.append(start)
        extend.append(end - start)
        positions += range(start, end)
        kv_locs += range(next_loc, next_loc + end - start)
        cached[row] += range(next_loc, next_loc + end - start)
        rows += [row] * (end - start)
        next_loc += end - start
    def i64(xs):
        return torch.tensor(xs, dtype=torch.int64)
    def i32(xs):
        return torch.tensor(xs, dtype=torch.int32)
    fill_req_to_token(cache, i64(rows), i64(positions), i64(kv_locs))
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    return ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=i64(positions), kv_locs=i64(kv_locs),
        req_rows=i32([r for r, _, _ in items]), prefix_lens=i32(prefix), extend_lens=i32(extend),
        seq_lens=i32(seq_lens), q_start_locs=i32(q_start),
        logits_indices=i64([s + e - 1 for s, e in zip(q_start, extend)]),
        num_decode=num_decode, max_seq_len=max(seq_lens),
        max_extend_len=max(extend[num_decode:], default=0), req_to_token=cache.req_to_token)


def _run_steps(layers, xs, dtype=torch.float32):
    """Step 1: prefill rows 0 and 1 (row 1 only 10 of its 14 tokens). Step 2: decode row 0's last token, the rest
    of row 1 after its cached prefix, all of row 2. Returns {row: [n, hidden]} per step. `layers`: one MLAAttention
    per TP rank, whose partial outputs are summed (the all-reduce)."""
    cache = LatentKVCache(1, 64, 32 + 16, 4, 32, dtype)
    cached = {}
    results = []
    for items, nd in ([(0, 0, 9), (1, 0, 10)], 0), ([(0, 9, 10), (1, 10, 14), (2, 0, 5)], 1):
        batch = _step(cache, cached, items, nd)
        x = torch.cat([xs[row][start:end] for row, start, end in items]).to(dtype)
        out = sum(layer(x, batch, cache.latent_caches[0]) for layer in layers)
        results.append({row: out[q:q + e - s] for (row, s, e), q in zip(items, batch.q_start_locs.tolist())})
    return results


@pytest.mark.parametrize("q_lora_rank, interleave, rope", [(48, True, YARN), (None, True, None), (48, False, None),
                                                            (None, False, YARN)])
def test_mla_attention_matches_transformers(q_lora_rank, interleave, rope):
    attn, rotary, hf = _hf_attention(q_lora_rank, interleave, rope)
    config = MLAConfig.from_hf(hf)
    assert config.sm_scale == pytest.approx(attn.scaling)
    torch.manual_seed(1)
    xs = {row: torch.randn(n, 64) for row, n in LENS.items()}
    expect = _hf_outputs(attn, rotary, xs)
    tensors = {f"{PREFIX}self_attn.{k}": v for k, v in attn.state_dict().items()}
    layer = MLAAttention(config, load_mla_weights(tensors, PREFIX, config, torch.float32), build_mla_cos_sin(config))
    step1, step2 = _run_steps([layer], xs)
    torch.testing.assert_close(step1[0], expect[0][:9], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step1[1], expect[1][:10], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step2[0], expect[0][9:], atol=1e-5, rtol=1e-4)  # absorbed decode
    torch.testing.assert_close(step2[1], expect[1][10:], atol=1e-5, rtol=1e-4)  # chunk after a cached prefix
    torch.testing.assert_close(step2[2], expect[2], atol=1e-5, rtol=1e-4)


def test_cos_sin_matches_transformers_rotary_embedding():
    _, rotary, hf = _hf_attention(None, True, YARN)
    cos, sin = rotary(torch.zeros(1), torch.arange(128)[None])
    table = build_mla_cos_sin(MLAConfig.from_hf(hf))
    torch.testing.assert_close(table, torch.cat([cos[0, :, :8], sin[0, :, :8]], dim=-1), rtol=0, atol=0)


def test_tp_ranks_sum_to_the_whole_layer():
    attn, rotary, hf = _hf_attention(48, True, YARN)
    config = MLAConfig.from_hf(hf)
    torch.manual_seed(1)
    xs = {row: torch.randn(n, 64) for row, n in LENS.items()}
    expect = _hf_outputs(attn, rotary, xs)
    tensors = {f"{PREFIX}self_attn.{k}": v for k, v in attn.state_dict().items()}
    cos_sin = build_mla_cos_sin(config)
    layers = [MLAAttention(config, load_mla_weights(tensors, PREFIX, config, torch.float32, tp_rank=r, tp_size=2),
                           cos_sin) for r in range(2)]
    assert layers[0].num_heads == 2
    _, step2 = _run_steps(layers, xs)
    torch.testing.assert_close(step2[0], expect[0][9:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step2[1], expect[1][10:], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_mla_weights(tensors, PREFIX, config, torch.float32, tp_rank=0, tp_size=3)


def test_mla_attention_bfloat16_is_close_to_transformers():
    attn, rotary, hf = _hf_attention(48, True, YARN)
    config = MLAConfig.from_hf(hf)
    torch.manual_seed(1)
    xs = {row: torch.randn(n, 64) for row, n in LENS.items()}
    expect = _hf_outputs(attn, rotary, xs)  # float32
    tensors = {f"{PREFIX}self_attn.{k}": v for k, v in attn.state_dict().items()}
    layer = MLAAttention(config, load_mla_weights(tensors, PREFIX, config, torch.bfloat16), build_mla_cos_sin(config))
    _, step2 = _run_steps([layer], xs, torch.bfloat16)
    for row, sl in ((0, slice(9, 10)), (1, slice(10, 14)), (2, slice(0, 5))):
        assert step2[row].dtype == torch.bfloat16
        torch.testing.assert_close(step2[row].float(), expect[row][sl], atol=5e-2, rtol=5e-2)
