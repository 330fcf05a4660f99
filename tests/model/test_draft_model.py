"""--speculative_algorithm draft at the worker: a ModelRunner with a draft model serves plans as the router makes
them (prompt chunks, plain decodes and speculating rows of placeholder drafts in one step, KV rows taken from and
given back to a free list, so a rejected draft's row soon holds another request's token), and

- every draft it proposes is the draft model's own greedy continuation of the request's tokens so far, computed
  apart in a fresh cache (so its KV cache, which mirrors the served model's rows, holds the right rows: those of
  prompt chunks, plain decodes, accepted drafts and the last draft of a step, and none of a rejected one);
- the served model's greedy output is the same as without speculation;
- with the served model itself as the draft (float32), every draft is accepted.

On the C kernels for two families. (The draft runs the model code any served model runs; tests/model/test_mtp.py
runs a drafter through the Triton kernels.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightserve.config import Device, KernelBackend, ServerConfig, SpeculativeAlgorithm
from lightserve.engine.procs import StartError
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import read_model_config
from lightserve.resolve_config import resolve_config
from tests.e2e.server import MODEL_DIR

from .mini_router import MAX_LEN, PROMPTS, MiniRouter, greedy, mixed_drafts
from .ranks import run_ranks
from .tiny_models import load_model_dir, make_tiny_model

TP_STEPS = 8


def _draft_of(target_dir: Path, out_dir: Path, damp: float) -> Path:
    """A draft that agrees with the served model some of the time: a copy of it whose last layer's MLP output is
    scaled by `damp`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target_dir, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    last = max(int(name.split(".")[2]) for name in weights if name.startswith("model.layers."))
    weights[f"model.layers.{last}.mlp.down_proj.weight"] *= damp
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("kind,backend,steps", [("llama3", KernelBackend.CPU, 14), ("qwen3", KernelBackend.CPU, 14)])
def test_draft_proposals_and_output(tmp_path, kind, backend, steps):
    target_dir = make_tiny_model(kind, tmp_path / "target", num_hidden_layers=3)
    draft_dir = _draft_of(target_dir, tmp_path / "draft", damp=0.5)
    router = _serve(target_dir, draft_dir, steps, backend=backend)
    assert 0 < router.accepted < router.drafted   # drafts both accepted and rejected
    draft = router.runner.draft.model
    for r, seq, drafts in router.proposals:
        assert drafts == greedy(draft, seq, len(drafts)), (r, len(seq))
    target = load_model_dir(target_dir, torch.float32)
    for r, prompt in enumerate(PROMPTS):
        out = router.seqs[r][len(prompt):]
        assert out == greedy(target, prompt, len(out)), r


def _serve(target_dir, draft_dir, steps: int, tp_rank: int = 0, tp_size: int = 1,
           backend: KernelBackend = KernelBackend.CPU, k_of=None) -> MiniRouter:
    """MiniRouter's requests over `steps` steps, request 0 drafting 3 each step, request 1 alternating 4 and a plain
    decode, request 2 drafting 1, 2, 3 in turn (mini_router.mixed_drafts), or k_of(request, step) drafts."""
    runner = ModelRunner(str(target_dir), read_model_config(target_dir), torch.float32, torch.device("cpu"), tp_rank,
                         tp_size, dist.group.WORLD if tp_size > 1 else None, num_req_rows=len(PROMPTS),
                         max_req_total_len=MAX_LEN, kv_size=400, kernel_backend=backend,
                         draft=(str(draft_dir), read_model_config(draft_dir)))
    return MiniRouter(runner, PROMPTS).run(steps, k_of or mixed_drafts)


def _rank_main(rank: int, port: int, target_dir: str, draft_dir: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        router = _serve(target_dir, draft_dir, TP_STEPS, rank, 2)
        if rank == 0:
            Path(out_path).write_text(json.dumps([router.seqs, [p[2] for p in router.proposals]]))
    finally:
        dist.destroy_process_group()


def test_tp2_proposes_and_outputs_what_tp1_does(tmp_path):
    """Every rank runs the draft over its own shard and proposes the same drafts (the logits are gathered before
    the argmax): the drafts and tokens are those of one rank."""
    target_dir = make_tiny_model("llama3", tmp_path / "target", num_hidden_layers=3)
    draft_dir = _draft_of(target_dir, tmp_path / "draft", damp=0.5)
    out_path = tmp_path / "tp2.json"
    assert run_ranks(_rank_main, 2, str(target_dir), str(draft_dir), str(out_path)) == [0, 0]
    one = _serve(target_dir, draft_dir, TP_STEPS)
    assert json.loads(out_path.read_text()) == [one.seqs, [p[2] for p in one.proposals]]
    assert one.accepted > 0


def test_the_served_model_as_its_own_draft_is_always_accepted(tmp_path):
    target_dir = make_tiny_model("llama3", tmp_path / "target")
    router = _serve(target_dir, target_dir, 10, k_of=lambda r, s: 4)
    assert router.drafted > 40 and router.accepted == router.drafted


def _with_tokenizer(model_dir: Path, swap: bool = False) -> Path:
    """The bundled model's tokenizer beside a tiny model's weights; `swap`: with two tokens' ids exchanged."""
    vocab_files = ("tokenizer.json", "tokenizer_config.json")
    for name in vocab_files:
        shutil.copy2(MODEL_DIR / name, model_dir / name)
    if swap:
        data = json.loads((model_dir / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
        (model_dir / "tokenizer.json").write_text(json.dumps(data))
    return model_dir


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused_at_start(tmp_path):
    target = _with_tokenizer(make_tiny_model("llama3", tmp_path / "target"))

    def start(draft: Path, **kw) -> None:
        resolve_config(ServerConfig(model_dir=str(target), device=Device.CPU, speculative_algorithm=
                                    SpeculativeAlgorithm.DRAFT, speculative_draft_model_dir=str(draft), **kw))

    start(_with_tokenizer(make_tiny_model("qwen3", tmp_path / "good")))   # another family, the same tokenizer
    for draft, why in ((make_tiny_model("llama3", tmp_path / "vocab", vocab_size=170), "a vocabulary of 170"),
                       (_with_tokenizer(make_tiny_model("llama3", tmp_path / "ids"), swap=True), "other ids"),
                       (make_tiny_model("llama3", tmp_path / "none"), "cannot compare its tokenizer"),
                       (tmp_path / "missing", "no config.json"),
                       (_with_tokenizer(make_tiny_model("llama3", tmp_path / "short", max_position_embeddings=100)),
                        "context of 100")):
        with pytest.raises(StartError, match=f"--speculative_draft_model_dir .*{why}"):
            start(draft, max_req_total_len=128)
