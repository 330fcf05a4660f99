"""Each tensor-parallel layer on its own, 2 gloo ranks against the unsharded model: column-parallel
q/k/v and gate/up, row-parallel o_proj (bias added once) and down, vocab-parallel embedding (ids on
both shards and the padded tail) and lm_head (all-gather, padding dropped)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from lightserve.kernels import linear  # plain or packed (CPU float32) weights

from .ranks import run_ranks
from .tiny_models import load_model_dir, make_tiny_model

TP = 2
VOCAB = 131  # odd: rank 1's vocab shard has one zero padding row


def _rank_main(rank: int, port: int, model_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        full = load_model_dir(model_dir, torch.float32)
        part = load_model_dir(model_dir, torch.float32, tp_rank=rank, tp_size=TP, tp_group=None)
        cfg, sh = full.config, part.weights.shards
        d, tol = cfg.head_dim, {"atol": 1e-5, "rtol": 1e-5}
        gen = torch.Generator().manual_seed(0)  # same inputs on both ranks
        x = torch.randn(5, cfg.hidden_size, generator=gen)  # [T, hidden]
        lf, lp = full.weights.layers[0], part.weights.layers[0]

        # Column-parallel q/k/v: this rank's output rows are its heads' rows of the full output.
        qkv = linear(x, lf.qkv_proj, lf.qkv_bias)  # [T, (Hq + 2 Hk) D]
        q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=1)
        lq, lk, lv = linear(x, lp.qkv_proj, lp.qkv_bias).split(
            [sh.num_heads * d, sh.num_kv_heads * d, sh.num_kv_heads * d], dim=1)
        torch.testing.assert_close(lq, q[:, sh.q_head_start * d:(sh.q_head_start + sh.num_heads) * d], **tol)
        kv_cols = slice(sh.kv_head_start * d, (sh.kv_head_start + sh.num_kv_heads) * d)
        torch.testing.assert_close(lk, k[:, kv_cols], **tol)
        torch.testing.assert_close(lv, v[:, kv_cols], **tol)

        # Row-parallel o_proj: partial sums over this rank's heads, all-reduced, bias once.
        o = torch.randn(5, cfg.num_heads * d, generator=gen)  # [T, Hq D]
        o_local = o[:, sh.q_head_start * d:(sh.q_head_start + sh.num_heads) * d]
        out = linear(o_local, lp.o_proj)
        dist.all_reduce(out)
        torch.testing.assert_close(out + lp.o_bias, linear(o, lf.o_proj, lf.o_bias), **tol)

        # Column-parallel gate/up then row-parallel down, through the model's own MLP.
        torch.testing.assert_close(part._mlp(lp, x), full._mlp(lf, x), **tol)
        # Vocab-parallel embedding: every id, each owned by one rank.
        ids = torch.arange(VOCAB)
        torch.testing.assert_close(part._embed(ids), full._embed(ids), **tol)
        # Vocab-parallel lm_head: [T, VOCAB] after the all-gather, the padding row dropped.
        logits = part._logits(x)
        assert logits.shape == (5, VOCAB)
        torch.testing.assert_close(logits, full._logits(x), **tol)
    finally:
        dist.destroy_process_group()


def test_each_parallel_layer_matches_unsharded(tmp_path: Path):
    model_dir = make_tiny_model("llama_bias", tmp_path / "model", vocab_size=VOCAB)
    assert run_ranks(_rank_main, TP, str(model_dir)) == [0] * TP
