"""Our forward against transformers' on tiny random models of every supported architecture (every
family of the registry): a ragged prefill, decode steps through our KV cache, and a mixed decode + extend
batch; the windowed models' prompts run past their window."""
from __future__ import annotations

import pytest
import torch

from lightserve.model_infer.models import check_tp, config_from_dict, deepseek

from .fake_worker import FakeWorker
from .tiny_models import ARCHS, load_model_dir, make_tiny_model

TOL = {"atol": 2e-5, "rtol": 1e-5}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    import transformers

    model_dir = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model_dir(model_dir, dtype=torch.float32)
    return hf, ours


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of one unpadded sequence."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_prefill_decode_and_mixed_batch_match_transformers(tiny):
    hf, ours = tiny
    gen = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 11, 1, 27)]
    worker = FakeWorker(ours)
    seqs = {row: list(p) for row, p in enumerate(prompts)}

    # Ragged prefill of all four; every position's logits, not only the last.
    logits = worker.step([(row, seqs[row]) for row in seqs], num_decode=0, all_logits=True)
    expected = torch.cat([hf_logits(hf, seqs[row]) for row in seqs])
    torch.testing.assert_close(logits, expected, **TOL)

    # Three batched decode steps, feeding back our own greedy tokens.
    next_ids = {row: int(hf_logits(hf, seqs[row])[-1].argmax()) for row in seqs}
    for _ in range(3):
        for row, seq in seqs.items():
            seq.append(next_ids[row])
        logits = worker.step([(row, [seqs[row][-1]]) for row in seqs], num_decode=len(seqs))
        expected = torch.stack([hf_logits(hf, seqs[row])[-1] for row in seqs])
        torch.testing.assert_close(logits, expected, **TOL)
        next_ids = {row: int(i) for row, i in zip(seqs, logits.argmax(-1))}

    # Mixed: rows 0-2 decode while row 4 extends 4 tokens after 6 cached ones borrowed from row 1
    # (a prefix-cache hit), and row 5 prefills from scratch.
    for row in (0, 1, 2):
        seqs[row].append(next_ids[row])
    worker.share_prefix(4, 1, 6)
    seqs[4] = seqs[1][:6] + torch.randint(3, vocab, (4,), generator=gen).tolist()
    seqs[5] = torch.randint(3, vocab, (3,), generator=gen).tolist()
    items = [(row, [seqs[row][-1]]) for row in (0, 1, 2)] + [(4, seqs[4][6:]), (5, seqs[5])]
    logits = worker.step(items, num_decode=3)
    expected = torch.stack([hf_logits(hf, seqs[row])[-1] for row, _ in items])
    torch.testing.assert_close(logits, expected, **TOL)


def test_rope_cache_matches_transformers_bit_for_bit(tiny):
    hf, ours = tiny
    cfg = ours.config
    half = cfg.head_dim // 2
    x = torch.zeros(1, dtype=torch.float32)

    def hf_table(positions, layer_type=None):  # [n, D]: cos then sin of HF's rotary embedding
        args = (layer_type,) if layer_type else ()
        cos, sin = hf.model.rotary_emb(x, torch.tensor(positions)[None], *args)  # [1, n, D] each
        return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)

    everywhere = list(range(cfg.max_position_embeddings))
    if cfg.rope_type == "longrope":
        # transformers picks the short or the long factors for a whole forward by its last position; our
        # table is per position, so each half matches the call that covers only it.
        split = cfg.rope_original_max_position_embeddings
        assert torch.equal(ours.cos_sin[:split], hf_table(list(range(split))))
        assert torch.equal(ours.cos_sin[split:], hf_table(everywhere)[split:])
    elif cfg.rope_local_theta is not None:  # Gemma 3: the windowed layers' own base
        assert torch.equal(ours.layer_rope[1], hf_table(everywhere, "full_attention"))
        assert torch.equal(ours.layer_rope[0], hf_table(everywhere, "sliding_attention"))
        assert not torch.equal(ours.layer_rope[0], ours.layer_rope[1])
    else:
        assert torch.equal(ours.cos_sin, hf_table(everywhere))


def test_config_reads_old_and_new_rope_forms():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256,
                "eos_token_id": [2, 3]}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = config_from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    new = config_from_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old == new
    assert (new.rope_type, new.rope_theta, new.rope_original_max_position_embeddings) == ("llama3", 5e5, 64)
    assert new.eos_token_ids == (2, 3) and new.head_dim == 16


def test_config_refuses_other_architectures():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        config_from_dict({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64, "num_attention_heads": 4})


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_bfloat16_forward_follows_transformers_bfloat16(arch, tmp_path):
    """The bf16 CPU forward (C norms, rotary, activation and attention on bf16 activations and KV) against
    transformers in bf16: a ragged prefill and decode steps. The two round in different places (attention
    accumulates in float32 here), so logits agree to bf16 noise, not bit for bit; greedy tokens agree
    wherever transformers' own top two are not a near tie."""
    import transformers

    model_dir = make_tiny_model(arch, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ours = load_model_dir(model_dir, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 40, 2)]
    worker = FakeWorker(ours)
    seqs = {row: list(p) for row, p in enumerate(prompts)}
    logits = worker.step([(row, seqs[row]) for row in seqs], num_decode=0)
    for _ in range(4):
        expected = torch.stack([hf_logits(hf, seqs[row])[-1] for row in seqs])  # [B, V]
        scale = expected.abs().max()
        torch.testing.assert_close(logits, expected, atol=0.05 * float(scale), rtol=0.05)
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
        assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])
        for row, tok in zip(seqs, expected.argmax(-1).tolist()):  # teacher forcing: transformers' choice
            seqs[row].append(tok)
        logits = worker.step([(row, [seqs[row][-1]]) for row in seqs], num_decode=len(seqs))


def test_moe_config_reads_sparse_layers_windows_and_refuses_uneven_tp():
    from lightserve.model_infer.models import check_tp

    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
            "mlp_only_layers": [3], "use_sliding_window": True, "sliding_window": 16}
    cfg = config_from_dict(base)
    assert (cfg.moe_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.head_dim) == ((1,), 8, 48, 16)
    assert cfg.layer_windows == (16,) * 4 and cfg.qk_norm
    check_tp(cfg, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size 48"):
        check_tp(cfg, 5)
    mixtral = config_from_dict({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                                "sliding_window": None})
    assert mixtral.moe_layers == (0, 1, 2, 3) and mixtral.moe_intermediate_size == 128 and mixtral.norm_topk_prob
    assert not mixtral.qk_norm and mixtral.layer_windows == ()


def test_deepseek_config_keeps_its_layer_configs_and_refuses_what_it_does_not_serve():
    import transformers

    from lightserve.model_infer.mla_layer import MLAConfig
    from lightserve.model_infer.moe_layers import MoEConfig

    hf = {**transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=5, num_attention_heads=6,
        vocab_size=100, max_position_embeddings=256, first_k_dense_replace=2, n_routed_experts=8, n_group=4,
        topk_group=2, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 0.7}).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    cfg = config_from_dict(hf)
    assert cfg.moe_layers == (2, 3, 4) and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 8)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_type) == (16, 6, "yarn")
    assert deepseek.mla_config(cfg) == MLAConfig.from_hf(hf) and deepseek.moe_config(cfg) == MoEConfig.from_hf(hf)
    assert cfg.sm_scale == MLAConfig.from_hf(hf).sm_scale != 40 ** -0.5  # yarn's mscale^2 on (Dn + Dr)^-0.5
    check_tp(cfg, 2)
    check_tp(cfg, 3)  # heads, intermediate_size and moe_intermediate_size all split in 3
    with pytest.raises(ValueError, match="6 attention heads"):
        check_tp(cfg, 4)
    with pytest.raises(ValueError, match="moe_intermediate_size 48"):
        check_tp(config_from_dict({**hf, "num_attention_heads": 10, "moe_intermediate_size": 48}), 5)
    with pytest.raises(ValueError, match="intermediate_size 96"):
        check_tp(config_from_dict({**hf, "num_attention_heads": 10, "moe_intermediate_size": 40}), 5)
    for key, value in (("topk_method", "greedy"), ("scoring_func", "softmax"), ("moe_layer_freq", 2),
                       ("n_group", 3), ("hidden_act", "gelu")):
        with pytest.raises(ValueError, match=key if key != "n_group" else "n_routed_experts 8 .* n_group 3"):
            config_from_dict({**hf, key: value})
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        config_from_dict({**hf, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})


def test_deepseek_serves_the_main_model_of_a_checkpoint_with_an_mtp_layer(tmp_path):
    """DeepSeek-V3 ships one multi-token-prediction layer after the main ones (model.layers.61.* with eh_proj,
    enorm, hnorm and a whole decoder layer); it is not loaded and changes nothing."""
    from safetensors.torch import save_file

    model_dir = make_tiny_model("deepseek_v3", tmp_path)
    ours = load_model_dir(model_dir, dtype=torch.float32)
    num_layers = ours.config.num_layers
    prompt = [5, 9, 17, 33, 2, 8]
    expected = FakeWorker(ours).step([(0, prompt)], num_decode=0)
    mtp = f"model.layers.{num_layers}."
    save_file({mtp + "eh_proj.weight": torch.randn(64, 128), mtp + "enorm.weight": torch.ones(64),
               mtp + "self_attn.kv_a_proj_with_mqa.weight": torch.randn(48, 64)}, model_dir / "mtp.safetensors")
    with_mtp = load_model_dir(model_dir, dtype=torch.float32)
    assert with_mtp.config.num_layers == num_layers and len(with_mtp.mla_layers) == num_layers
    assert torch.equal(FakeWorker(with_mtp).step([(0, prompt)], num_decode=0), expected)
