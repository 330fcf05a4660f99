"""--speculative_algorithm mtp at the worker: a tiny random DeepSeek-V3 with a multi-token-prediction layer
(model.layers.3.*: enorm, hnorm, eh_proj, a MoE decoder layer, shared_head), served by a ModelRunner (the C kernels,
and the Triton kernels under the interpreter) through MiniRouter's plans (prompt chunks, plain decodes, speculating
rows; rejected rows reused at once).

- Every draft is what DeepSeek-V3's MTP computes, written here with transformers' own modules: the served model's
  final-normed states over the request's tokens, the MTP rows over them (eh_proj of the normed embedding of the
  next token and the normed state), the MoE decoder layer, the shared head; each further draft chains the MTP's own
  output state. (transformers does not run MTP layers; its decoder layer and norms do the math here.)
- The served model's greedy output is the same as without speculation.
- Two ranks propose and output what one does.
- Start-time refusals: mtp on another family, or on a DeepSeek-V3 checkpoint without the layer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightserve.config import Device, KernelBackend, ServerConfig, SpeculativeAlgorithm
from lightserve.engine.procs import StartError
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import read_model_config
from lightserve.resolve_config import resolve_config

from .mini_router import MAX_LEN, PROMPTS, MiniRouter, greedy
from .ranks import run_ranks
from .tiny_models import MTP_NUM_LAYERS, load_model_dir, make_mtp_checkpoint, make_tiny_model

TP_STEPS = 6


class ReferenceMtp:
    """DeepSeek-V3's MTP over transformers' modules: the served model (its 3 layers) and a one-layer model holding
    the MTP layer, its final norm the shared head's norm and its lm_head the shared head."""

    def __init__(self, model_dir: Path, work_dir: Path):
        """`work_dir`: where the one-layer model is written in the checkpoint's format, for transformers to load."""
        import transformers
        from safetensors.torch import load_file, save_file
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.target = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        config = transformers.AutoConfig.from_pretrained(model_dir)
        config.num_hidden_layers, config.first_k_dense_replace, config.tie_word_embeddings = 1, 0, False
        weights = load_file(model_dir / "model.safetensors")
        mtp = f"model.layers.{MTP_NUM_LAYERS}."
        state = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"],
                 "model.norm.weight": weights[mtp + "shared_head.norm.weight"],
                 "lm_head.weight": weights[mtp + "shared_head.head.weight"]}
        state |= {"model.layers.0." + k[len(mtp):]: v for k, v in weights.items()
                  if k.startswith(mtp) and not k[len(mtp):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))}
        config.save_pretrained(work_dir)
        save_file(state, work_dir / "model.safetensors", metadata={"format": "pt"})
        self.mtp = transformers.AutoModelForCausalLM.from_pretrained(work_dir, dtype=torch.float32).eval()
        eps = config.rms_norm_eps
        self.enorm, self.hnorm = DeepseekV3RMSNorm(config.hidden_size, eps), DeepseekV3RMSNorm(config.hidden_size, eps)
        self.enorm.weight.data, self.hnorm.weight.data = weights[mtp + "enorm.weight"], weights[mtp + "hnorm.weight"]
        self.eh_proj = weights[mtp + "eh_proj.weight"]

    @staticmethod
    def _norm_input_and_logits(model, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm's input [L, hidden], logits [L, V]) of one forward."""
        seen = {}
        hook = model.model.norm.register_forward_hook(lambda mod, args, out: seen.update(pre=args[0], post=out))
        try:
            logits = model(**kw).logits[0]
        finally:
            hook.remove()
        return seen, logits

    @torch.no_grad()
    def drafts(self, seq: list[int], k: int) -> list[int]:
        """The k MTP drafts after `seq` (its last token the last sampled one)."""
        seen, _ = self._norm_input_and_logits(self.target, input_ids=torch.tensor([seq[:-1]]))
        states = seen["post"][0]                                   # [L-1, hidden] final-normed, positions < L-1
        tokens = torch.tensor(seq[1:])                             # the token after each of those positions
        out = []
        for _ in range(k):
            emb = self.mtp.model.embed_tokens(tokens)
            x = torch.cat([self.enorm(emb), self.hnorm(states)], dim=-1) @ self.eh_proj.T     # [n, hidden]
            seen, logits = self._norm_input_and_logits(self.mtp, inputs_embeds=x[None],
                                                        position_ids=torch.arange(x.shape[0])[None])
            out.append(int(logits[-1].argmax()))
            # Chain: the next row takes the draft and the MTP's own output state of this row.
            states = torch.cat([states, seen["pre"][0][-1:]])
            tokens = torch.cat([tokens, torch.tensor([out[-1]])])
        return out


def _serve(model_dir: Path, steps: int, tp_rank: int = 0, tp_size: int = 1,
           backend: KernelBackend = KernelBackend.CPU) -> MiniRouter:
    """MiniRouter's requests over `steps` steps of mini_router.mixed_drafts."""
    runner = ModelRunner(str(model_dir), read_model_config(model_dir), torch.float32, torch.device("cpu"), tp_rank,
                         tp_size, dist.group.WORLD if tp_size > 1 else None, num_req_rows=len(PROMPTS),
                         max_req_total_len=MAX_LEN, kv_size=400, kernel_backend=backend, mtp=True)
    return MiniRouter(runner, PROMPTS).run(steps)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "model")


@pytest.mark.parametrize("backend,steps", [(KernelBackend.CPU, 10), (KernelBackend.TRITON, 3)])
def test_mtp_drafts_match_deepseek_v3_and_output_is_unchanged(mtp_dir, tmp_path, backend, steps):
    router = _serve(mtp_dir, steps, backend=backend)
    assert len(router.proposals) >= steps
    ref = ReferenceMtp(mtp_dir, tmp_path / "reference")
    for r, seq, drafts in router.proposals:
        assert drafts == ref.drafts(seq, len(drafts)), (r, len(seq))
    target = load_model_dir(mtp_dir, torch.float32)
    for r, prompt in enumerate(PROMPTS):
        out = router.seqs[r][len(prompt):]
        assert out == greedy(target, prompt, len(out)), r


def _rank_main(rank: int, port: int, model_dir: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        router = _serve(Path(model_dir), TP_STEPS, rank, 2)
        if rank == 0:
            Path(out_path).write_text(json.dumps([router.seqs, [p[2] for p in router.proposals]]))
    finally:
        dist.destroy_process_group()


def test_tp2_proposes_and_outputs_what_tp1_does(mtp_dir, tmp_path):
    """The MTP layer split over two ranks (its heads and experts; eh_proj and the latents replicated) proposes the
    drafts one rank does."""
    out_path = tmp_path / "tp2.json"
    assert run_ranks(_rank_main, 2, str(mtp_dir), str(out_path)) == [0, 0]
    one = _serve(mtp_dir, TP_STEPS)
    assert json.loads(out_path.read_text()) == [one.seqs, [p[2] for p in one.proposals]]
    assert len(one.proposals) >= TP_STEPS


def test_mtp_is_refused_where_the_model_has_no_mtp_layer(tmp_path, mtp_dir):
    def start(model_dir: Path) -> None:
        resolve_config(ServerConfig(model_dir=str(model_dir), device=Device.CPU,
                                    speculative_algorithm=SpeculativeAlgorithm.MTP))

    start(mtp_dir)
    with pytest.raises(StartError, match="--speculative_algorithm mtp: LlamaForCausalLM has no"):
        start(make_tiny_model("llama3", tmp_path / "llama"))
    plain = make_tiny_model("deepseek_v3", tmp_path / "plain")   # transformers' config names one MTP layer
    with pytest.raises(StartError, match="no model.layers.3.eh_proj.weight"):
        start(plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(StartError, match="--speculative_algorithm mtp: .*no num_nextn_predict_layers"):
        start(plain)
