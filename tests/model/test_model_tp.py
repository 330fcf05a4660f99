"""Tensor parallelism on CPU with gloo: 2 ranks over a model with 1 kv head (so it is replicated)
and an odd vocabulary (so the vocab shards are padded) give the same logits as one rank, for each family:
Llama (biases), Gemma 2 (scaled embedding, soft-capped logits after the gather), Phi-3 (fused projections
cut per rank), Qwen3-MoE (each expert's intermediate dim split, a dense layer among the MoE ones), DeepSeek-V3
(latent attention's heads split over a replicated latent cache, experts and the shared expert split)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightserve.model_infer.models.base import DecoderLM

from .fake_worker import FakeWorker
from .ranks import run_ranks
from .tiny_models import load_model_dir, make_tiny_model

TP = 2
VOCAB = 131
PROMPTS = [[5, 9, 17, 33, 2, 8, 101], [7, 7, 64], [129, 3, 11, 12, 40]]


def _run(model: DecoderLM) -> list[torch.Tensor]:
    """A prefill of all prompts, then two decode steps."""
    worker = FakeWorker(model)
    out = [worker.step(list(enumerate(PROMPTS)), num_decode=0)]
    for token in (42, 43):
        out.append(worker.step([(row, [token]) for row in range(len(PROMPTS))], num_decode=len(PROMPTS)))
    return out


def _rank_main(rank: int, port: int, model_dir: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        model = load_model_dir(model_dir, torch.float32, tp_rank=rank, tp_size=TP, tp_group=None)
        logits = _run(model)
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama_bias", "gemma2", "phi3", "qwen3_moe", "deepseek_v3"])
def test_tp2_logits_equal_tp1(tmp_path: Path, kind: str):
    model_dir = make_tiny_model(kind, tmp_path / "model", vocab_size=VOCAB, num_key_value_heads=1)
    expected = _run(load_model_dir(model_dir, torch.float32))

    out_path = tmp_path / "tp_logits.pt"
    assert run_ranks(_rank_main, TP, str(model_dir), str(out_path)) == [0] * TP
    got = torch.load(out_path)
    for g, e in zip(got, expected):
        assert g.shape == e.shape == (len(PROMPTS), VOCAB)
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
