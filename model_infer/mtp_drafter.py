"""MtpDrafter: --speculative_algorithm mtp on a worker rank. DeepSeek-V3's multi-token-prediction layer proposes each
speculating request's draft tokens from the served model's own hidden states.

The MTP layer (checkpoint names model.layers.{N}.*, N = num_hidden_layers) is one more decoder layer (MLA attention
over a latent cache of its own, an MoE block) behind a fusion of two inputs. Its row at position p takes h_p, the
served model's final-normed hidden state at p, and the embedding of token p + 1, and predicts token p + 2:

    x = eh_proj([enorm(embed(t[p+1])), hnorm(h[p])])          eh_proj [hidden, 2 * hidden]
    g = layer(x)  (its K/V written at p's KV row)               g [hidden]: the next chained row's h
    logits = shared_head.head(shared_head.norm(g))

So it runs one position behind the served model: a row needs the token after it. The worker keeps, per request, the
hidden states and KV rows of the positions the served model computed last step (`keep`, after the forward), and at
the start of the next step (`propose`, before it), when the plan's prefix length says how many of them stand (the
router kept the accepted drafts' rows) and its first token is the one after them, runs the MTP layer over those
positions (catch-up rows, writing its KV cache at the served model's rows). A speculating request's last catch-up row
predicts its first draft; each further draft chains the MTP's own output state with the draft before, at the KV row
the plan gave that draft's position (the next step's catch-up rewrites it from the served model's state, as vLLM
does). Drafts are the argmax, a point-mass proposal as the other proposers' (spec_verify.accept_sampled).

A request's prompt positions are caught up over the steps of its prefill; positions matched in the prefix cache
keep the MTP rows a request that computed them wrote, except the last position of a request that finished (never
caught up): an MTP row read there holds another token's state, which only lowers acceptance (every draft is still
verified by the served model).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lightserve import kernels
from lightserve.messages import BatchPlan
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.models.base import AttentionInputs
from lightserve.model_infer.models.deepseek import DeepseekV3ForCausalLM, mtp_layer_index, read_weights, tp_shards
from lightserve.model_infer.weights import CheckpointReader

if TYPE_CHECKING:
    from lightserve.config import KernelBackend
    from lightserve.model_config import ModelConfig
    from lightserve.model_infer.forward_batch import ForwardBatch
    from lightserve.model_infer.latent_kv_cache import LatentKVCache


class _Renamed:
    """A safetensors handle seen under other names: `real` maps a name asked for to the file's."""

    def __init__(self, handle, real: dict[str, str]):
        self.handle, self.real = handle, real

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.real[name])

    def get_slice(self, name: str):
        return self.handle.get_slice(self.real[name])


class MtpCheckpointReader(CheckpointReader):
    """The checkpoint with the MTP layer N seen as a one-layer DeepSeek-V3: model.layers.0.* is model.layers.N.*, the
    final norm and lm_head are its shared_head's, the embedding its own copy where it has one."""

    def __init__(self, model_dir: Path, index: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(model_dir, dtype, device)
        mtp, where = f"model.layers.{index}.", self._where
        seen = {name: h for name, h in where.items() if not name.startswith("model.layers.")}
        for name, h in where.items():
            if name.startswith(mtp):
                ours = "model.layers.0." + name[len(mtp):]
                seen[ours] = _Renamed(h, {ours: name})
        for ours, theirs in (("model.norm.weight", "shared_head.norm.weight"),
                             ("lm_head.weight", "shared_head.head.weight"),
                             ("model.embed_tokens.weight", "embed_tokens.weight")):
            if mtp + theirs in where:
                seen[ours] = _Renamed(where[mtp + theirs], {ours: mtp + theirs})
        self._where = seen


class MtpModel(DeepseekV3ForCausalLM):
    """The MTP layer as a one-layer DeepSeek-V3 (its attention, MoE block, shared-head norm and lm_head), plus the
    fusion of its two inputs (enorm, hnorm, eh_proj)."""

    enorm: torch.Tensor    # [hidden], the token embedding's norm
    hnorm: torch.Tensor    # [hidden], the served model's state's norm
    eh_proj: torch.Tensor  # [hidden, 2 * hidden], replicated on every rank

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device, tp_rank: int,
             tp_size: int, tp_group, backend: KernelBackend | None) -> MtpModel:
        index = mtp_layer_index(config)
        # The MTP layer is of the kind of the layers before it: MoE where the model's last layers are.
        one = dataclasses.replace(config, num_layers=1, moe_layers=(0,) if config.moe_layers else ())
        reader = MtpCheckpointReader(Path(model_dir), index, dtype, device)
        try:
            weights = read_weights(reader, one, tp_shards(one, tp_rank, tp_size))
            fusion = [reader.full(f"model.layers.0.{name}.weight") for name in ("enorm", "hnorm", "eh_proj")]
        finally:
            reader.close()
        model = cls(one, weights, tp_rank, tp_size, tp_group, backend)
        model.enorm, model.hnorm, model.eh_proj = fusion  # [hidden], [hidden], [hidden, 2 * hidden]
        return model

    def forward_mtp(self, batch: ForwardBatch, kv_cache: LatentKVCache,
                    prev_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of batch.input_ids (each the token after its position) with `prev_hidden` [T, hidden] (the served
        model's state at each position, or the MTP's own for a chained row). Returns (float32 logits [S, vocab] of
        batch.logits_indices, the MTP output states g [T, hidden])."""
        cfg, eps, be = self.config, self.config.rms_norm_eps, self.backend
        layer = self.weights.layers[0]
        e = kernels.rmsnorm(self._embed(batch.input_ids), self.enorm, eps, be)       # [T, hidden]
        h = kernels.rmsnorm(prev_hidden, self.hnorm, eps, be)                        # [T, hidden]
        residual = kernels.linear(torch.cat([e, h], dim=-1), self.eh_proj)           # [T, hidden], fresh
        x = kernels.rmsnorm(residual, layer.input_norm, eps, be)
        x = self._attention(0, layer, x, batch, AttentionInputs.from_batch(batch), kv_cache)
        x = kernels.add_rmsnorm(x, residual, layer.post_attn_norm, eps, be)          # residual += attention
        g = self._ffn(0, layer, x) + residual                                        # [T, hidden]
        if batch.logits_indices.shape[0] == 0:
            return g.new_empty(0, cfg.vocab_size, dtype=torch.float32), g
        x = kernels.rmsnorm(g[batch.logits_indices], self.weights.final_norm, eps, be)
        return self._logits(x, batch.argmax_only), g


@dataclass
class _Pending:
    """What the served model computed for a request last step, for the MTP's catch-up: positions start ..
    start + n - 1, their final-normed states [n, hidden], tokens [n] and KV rows [n]."""
    req_id: int
    start: int
    hidden: torch.Tensor
    tokens: np.ndarray
    locs: np.ndarray


class MtpDrafter:
    wants_hidden = True  # ModelRunner asks the served model's forward for every token's state (ForwardBatch.hidden)

    def __init__(self, model: MtpModel, num_kv_rows: int, num_req_rows: int, max_req_total_len: int):
        self.model = model
        self.kv_cache = model.make_kv_cache(num_kv_rows, num_req_rows, max_req_total_len)
        self.staging = HostStaging(model.device)
        self.pending: dict[int, _Pending] = {}   # request slot -> last step's states

    @torch.inference_mode()
    def propose(self, plan: BatchPlan) -> None:
        """Catch the MTP layer up over each planned request's positions from last step that stand, and write each
        speculating row's drafts into plan.input_ids after its last sampled token."""
        extend = plan.extend_lens
        q_start = np.cumsum(extend, dtype=np.int32) - extend                    # [B]
        k = plan.spec_lens if plan.spec_lens.size else np.zeros(extend.size, np.int32)
        if plan.fill_rows.size:  # prefix-cache hits: the MTP rows of those positions are where the served model's are
            fill = [torch.from_numpy(a).to(self.model.device).long() for a in (plan.fill_rows, plan.fill_pos)]
            self.kv_cache.req_to_token[fill[0], fill[1]] = torch.from_numpy(plan.fill_locs).to(self.model.device)
        rows, ids, hiddens, locs, prefix, lens, drafting = [], [], [], [], [], [], []
        for b, slot in enumerate(plan.shm_indices.tolist()):
            p = self.pending.pop(slot, None)
            end = int(plan.prefix_lens[b])          # positions < end stand; the token at `end` is the plan's first
            if p is None or p.req_id != int(plan.req_ids[b]) or not p.start < end <= p.start + p.tokens.size:
                continue                            # nothing to catch up (a new, resumed or reused slot)
            n = end - p.start
            rows.append(b)
            ids.append(np.concatenate([p.tokens[1:n], plan.input_ids[q_start[b]: q_start[b] + 1]]))
            hiddens.append(p.hidden[:n])
            locs.append(p.locs[:n])
            prefix.append(p.start)
            lens.append(n)
            drafting.append(k[b] > 0)
        if not rows:
            return
        rows_a, drafting = np.array(rows), np.array(drafting)
        step = BatchPlan(step=plan.step, shm_indices=plan.shm_indices[rows_a], req_ids=plan.req_ids[rows_a],
                         prefix_lens=np.array(prefix, np.int32), extend_lens=np.array(lens, np.int32),
                         sample=drafting, input_ids=np.concatenate(ids).astype(np.int32),
                         kv_locs=np.concatenate(locs).astype(np.int32), num_decode=0)
        drafts, g = self._forward(step, torch.cat(hiddens))
        spec = rows_a[drafting]                                                   # [R] plan rows that speculate
        if not spec.size:
            return
        last = (np.cumsum(lens) - 1)[drafting]                                    # [R] their last catch-up row
        state = g[torch.from_numpy(last).to(g.device)]                            # [R, hidden]
        kk, starts = k[spec], q_start[spec]
        plan.input_ids[starts + 1] = drafts
        for j in range(1, int(kk.max())):
            # Each request still drafting: d_j (at position prefix + j) with the MTP state before it, in the MTP row
            # of position prefix + j - 1 (the KV row the plan gave that position) -> d_{j+1}.
            live = np.flatnonzero(kk > j)
            at = starts[live] + j
            chain = BatchPlan(step=plan.step, shm_indices=plan.shm_indices[spec[live]],
                              req_ids=plan.req_ids[spec[live]], prefix_lens=plan.prefix_lens[spec[live]] + j - 1,
                              extend_lens=np.ones(live.size, np.int32), sample=np.ones(live.size, bool),
                              input_ids=plan.input_ids[at], kv_locs=plan.kv_locs[at - 1], num_decode=live.size)
            index = torch.from_numpy(live).to(state.device)
            drafts, state[index] = self._forward(chain, state[index])
            plan.input_ids[at + 1] = drafts

    def keep(self, plan: BatchPlan, hidden: torch.Tensor) -> None:
        """After the served model's forward: every planned request's positions, tokens, KV rows and final-normed
        states `hidden` [T, hidden] for the next step's catch-up (in place of the last step's)."""
        extend = plan.extend_lens
        q_start = np.cumsum(extend, dtype=np.int32) - extend
        # Only this step's requests: one that sat a step out (paused, waiting) may have lost its KV rows since.
        self.pending = {}
        for b, slot in enumerate(plan.shm_indices.tolist()):
            q, n = int(q_start[b]), int(extend[b])
            self.pending[slot] = _Pending(int(plan.req_ids[b]), int(plan.prefix_lens[b]), hidden[q: q + n],
                                          plan.input_ids[q: q + n].copy(), plan.kv_locs[q: q + n].copy())

    def _forward(self, plan: BatchPlan, prev_hidden: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """One MTP forward: ([S] int32 argmax of each sampled row, the output states [T, hidden])."""
        batch = make_forward_batch(plan, self.kv_cache.req_to_token, self.staging, argmax_only=True)
        logits, g = self.model.forward_mtp(batch, self.kv_cache, prev_hidden)
        return logits.argmax(dim=-1).to(torch.int32).cpu().numpy(), g
