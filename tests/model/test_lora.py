"""Multi-LoRA serving on the model side: PEFT adapters made here (random weights, different ranks, targets, alphas,
one rsLoRA) read by lightserve.lora_adapter, held in model_infer.lora.LoraWeights, and applied in one batch that
mixes the base model and every adapter (an adapter's tokens in two runs of the batch). Each request's greedy tokens
equal transformers + peft's with its adapter merged, through the per-kernel forward and the CPU's one-call decoder
layers alike (bf16 stacks, --lora_dtype bfloat16: the first tokens); tp 2 over gloo gives the same;
read_lora_adapter refuses what it cannot serve, naming the culprit."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightserve.cli import make_config, parse_args
from lightserve.config import Device, DType, ServerConfig
from lightserve.kernels.lora import LoraSegments
from lightserve.lora_adapter import LoraAdapterError, load_lora_tensors, read_lora_adapter
from lightserve.messages import BatchPlan
from lightserve.model_infer import lora as lora_module
from lightserve.model_infer.lora import LoraLimits, LoraWeights
from lightserve.model_infer.model_runner import ModelRunner
from lightserve.model_infer.models import read_model_config
from lightserve.resolve_config import resolve_config

from .fake_worker import FakeWorker
from .ranks import run_ranks
from .tiny_models import load_model_dir, make_tiny_model

MAX_RANK = 8
NEW_TOKENS = 5
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft.LoraConfig arguments: different ranks (all <= MAX_RANK), targets (attention only, MLP and o, all),
# alphas (alpha != r) and one rsLoRA.
ADAPTERS = {
    "qv": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
    "mlp_rs": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ["o_proj", "gate_proj", "up_proj",
                                                                                "down_proj"]},
    "all": {"r": 2, "lora_alpha": 3, "target_modules": ALL},
}
# Requests: (prompt length, adapter or None for the base model). "qv" serves two requests, rows 0 and 3, so the
# batch holds its tokens in two runs; the last request joins one step late, its prompt beside the others' decodes.
REQS = [(7, "qv"), (5, None), (9, "mlp_rs"), (4, "qv"), (6, "all")]
# Fixture name -> (tiny model kind, its overrides). The tiny models' head_dim of 16 runs the per-kernel forward on
# CPU; "llama3_one_call"'s 64 is what the one-call decoder layers take (kernels/decoder_layers.py).
FAMILIES = {"llama3": ("llama3", {}), "gemma3": ("gemma3", {}), "llama3_one_call": ("llama3", {"hidden_size": 256})}


def make_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_args) -> Path:
    """A PEFT adapter of the base model with random A and B large enough to change its tokens."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora_args))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(out_dir)
    return out_dir


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_reference(base_dir: Path, adapter_dir: Path | None):
    """transformers' model in float32, with the adapter merged into its weights (peft's merge_and_unload)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    return model


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n, _ in REQS]


def run_ours(model, prompts: list[list[int]], slots: list[int], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of every request, batched: all but the last prefill in step 0; in step 1 they decode while the
    last prefills; then all decode until each has new_tokens."""
    worker = FakeWorker(model)
    out: list[list[int]] = [[] for _ in prompts]
    started = 0
    while any(len(o) < new_tokens for o in out):
        decodes = [row for row in range(started) if len(out[row]) < new_tokens]
        joining = list(range(started, len(prompts) - 1)) if started == 0 else list(range(started, len(prompts)))
        items = [(row, [out[row][-1]]) for row in decodes] + [(row, prompts[row]) for row in joining]
        logits = worker.step(items, num_decode=len(decodes), lora_slots=[slots[row] for row, _ in items])
        for (row, _), token in zip(items, logits.argmax(-1).tolist()):
            out[row].append(token)
        started += len(joining)
    return out


def attach_store(model, adapters: dict[str, Path], max_cpu_loras: int | None = None,
                 dtype: torch.dtype = torch.float32) -> LoraWeights:
    """A store of one slot per adapter (in ADAPTERS order) with stacks in `dtype`, loaded, attached to the model."""
    store = LoraWeights(model.config, model.weights.shards, LoraLimits(len(adapters), MAX_RANK, max_cpu_loras, dtype),
                        model.device)
    for slot, path in enumerate(adapters.values()):
        store.load(slot, str(path), slot)
    model.attach_lora(store)
    return store


def slots_of(adapters: dict[str, Path]) -> list[int]:
    names = list(adapters)
    return [-1 if name is None else names.index(name) for _, name in REQS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(base folder, adapter folders by name, each request's expected tokens from transformers + peft)."""
    root = tmp_path_factory.mktemp(request.param)
    kind, overrides = FAMILIES[request.param]
    base_dir = make_tiny_model(kind, root / "base", **overrides)
    adapters = {name: make_adapter(base_dir, root / name, seed, **args)
                for seed, (name, args) in enumerate(ADAPTERS.items())}
    prompts = prompts_for(read_model_config(base_dir).vocab_size)
    refs = {name: hf_reference(base_dir, adapters.get(name)) for name in (None, *ADAPTERS)}
    expected = [hf_greedy(refs[name], prompt, NEW_TOKENS) for prompt, (_, name) in zip(prompts, REQS)]
    # The adapters matter: each changes the tokens of some request it serves from the base model's.
    changed = {name for prompt, (_, name), tokens in zip(prompts, REQS, expected)
               if tokens != hf_greedy(refs[None], prompt, NEW_TOKENS)}
    assert changed >= set(ADAPTERS), set(ADAPTERS) - changed
    return base_dir, adapters, prompts, expected, refs


def test_mixed_batch_matches_transformers_with_each_adapter_merged(family):
    base_dir, adapters, prompts, expected, _ = family
    model = load_model_dir(base_dir, torch.float32)
    attach_store(model, adapters)
    assert run_ours(model, prompts, slots_of(adapters), NEW_TOKENS) == expected


@pytest.mark.parametrize("family", ["llama3_one_call"], indirect=True)
def test_the_one_call_layers_run_the_lora_steps(family):
    """Every step of the mixed batch runs in the CPU's one-call decoder layers, adapters and all: the same tokens."""
    base_dir, adapters, prompts, expected, _ = family
    model = load_model_dir(base_dir, torch.float32)
    if model.cpu_layers is None:
        pytest.skip("no C compiler here")
    attach_store(model, adapters)
    calls, run = [], model.cpu_layers.run

    def counted(*args):
        calls.append(args[-1])  # the step's LoRA segments
        return run(*args)

    model.cpu_layers.run = counted
    assert run_ours(model, prompts, slots_of(adapters), NEW_TOKENS) == expected
    # every step of run_ours (the last request joins one step late) with adapter segments
    assert len(calls) == NEW_TOKENS + 1 and all(segs is not None for segs in calls)


def test_bfloat16_activations_agree_on_the_first_tokens(family):
    base_dir, adapters, prompts, expected, _ = family
    model = load_model_dir(base_dir, torch.bfloat16)
    attach_store(model, adapters)
    got = run_ours(model, prompts, slots_of(adapters), 2)
    assert [g[0] for g in got] == [e[0] for e in expected]


def test_bfloat16_stacks_agree_on_the_first_tokens(family):
    """--lora_dtype bfloat16 over float32 activations: A and scaling * B rounded once to bf16 (the CPU cache holds
    them so too), products in float32; the first tokens are peft's merged in float32."""
    base_dir, adapters, prompts, expected, _ = family
    model = load_model_dir(base_dir, torch.float32)
    store = attach_store(model, adapters, dtype=torch.bfloat16)
    assert all(b.a.dtype == b.bt.dtype == torch.bfloat16 for groups in store.layers for b in groups.values())
    assert all(t.dtype == torch.bfloat16 for cached in store.cache.values() for pair in cached.modules.values()
               for t in pair)
    got = run_ours(model, prompts, slots_of(adapters), 2)
    assert [g[0] for g in got] == [e[0] for e in expected]


def test_slot_reload_and_cpu_cache(family, monkeypatch):
    base_dir, adapters, prompts, expected, refs = family
    model = load_model_dir(base_dir, torch.float32)
    store = attach_store(model, adapters, max_cpu_loras=3)
    # Slot 0 ("qv") now holds "all" (read from the cache: lora_id 2 is there): requests of slot 0 follow it.
    monkeypatch.setattr(lora_module, "read_lora_adapter", _no_disk_read)
    store.load(2, str(adapters["all"]), 0)
    got = run_ours(model, prompts, slots_of(adapters), NEW_TOKENS)
    for row, (_, name) in enumerate(REQS):
        want = hf_greedy(refs["all"], prompts[row], NEW_TOKENS) if name == "qv" else expected[row]
        assert got[row] == want, row
    # Back to "qv" from the cache, then a fourth adapter (read from disk) drops the least recently used ("mlp_rs").
    store.load(0, str(adapters["qv"]), 0)
    assert run_ours(model, prompts, slots_of(adapters), NEW_TOKENS) == expected
    monkeypatch.undo()
    store.load(3, str(adapters["all"]), 0)   # another id, same files: read from disk
    assert list(store.cache) == [2, 0, 3]


def _no_disk_read(*args, **kwargs):
    raise AssertionError("read from disk on a cache hit")


def test_steps_without_adapters_keep_the_lora_free_batch(family):
    base_dir, adapters, prompts, expected, _ = family
    worker = FakeWorker(load_model_dir(base_dir, torch.float32))
    assert worker.make_batch([(0, prompts[0])], 0).lora is None
    assert worker.make_batch([(1, prompts[1])], 0, lora_slots=[-1]).lora is None
    batch = worker.make_batch([(2, [5]), (3, [6, 7, 8]), (4, [9, 10])], 1, lora_slots=[1, 1, -1])
    assert isinstance(batch.lora, LoraSegments)
    assert batch.lora.host_starts.tolist() == [0] and batch.lora.host_lens.tolist() == [4]


def _rank_main(rank: int, port: int, base_dir: str, adapters: dict[str, str], prompts, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model_dir(base_dir, torch.float32, tp_rank=rank, tp_size=2, tp_group=None)
        attach_store(model, adapters)
        tokens = run_ours(model, prompts, slots_of(adapters), NEW_TOKENS)
        if rank == 0:
            Path(out_path).write_text(json.dumps(tokens))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama3"], indirect=True)  # the sharding is every family's same code
def test_tp2_gives_the_same_tokens(family, tmp_path):
    base_dir, adapters, prompts, expected, _ = family
    out_path = tmp_path / "tokens.json"
    assert run_ranks(_rank_main, 2, str(base_dir), {k: str(v) for k, v in adapters.items()}, prompts,
                     str(out_path)) == [0, 0]
    assert json.loads(out_path.read_text()) == expected


def test_model_runner_loads_adapters_and_runs_a_plan_with_lora_slots(family):
    base_dir, adapters, prompts, expected, _ = family
    runner = ModelRunner(str(base_dir), read_model_config(base_dir), torch.float32, torch.device("cpu"), 0, 1, None,
                         num_req_rows=len(REQS), max_req_total_len=32, kv_size=128,
                         lora=LoraLimits(len(ADAPTERS), MAX_RANK))
    for slot, path in enumerate(adapters.values()):
        runner.load_lora(10 + slot, str(path), slot)
    slots = slots_of(adapters)
    lens = np.array([len(p) for p in prompts], np.int32)
    plan = BatchPlan(step=1, shm_indices=np.arange(len(REQS), dtype=np.int32),
                     req_ids=np.arange(len(REQS), dtype=np.int64), prefix_lens=np.zeros(len(REQS), np.int32),
                     extend_lens=lens, sample=np.ones(len(REQS), bool),
                     input_ids=np.concatenate(prompts).astype(np.int32),
                     kv_locs=np.arange(1, 1 + lens.sum(), dtype=np.int32), num_decode=0,
                     lora_slots=np.array(slots, np.int32))
    assert runner.forward(plan).argmax(-1).tolist() == [e[0] for e in expected]
    plain = ModelRunner(str(base_dir), read_model_config(base_dir), torch.float32, torch.device("cpu"), 0, 1, None,
                        num_req_rows=1, max_req_total_len=32, kv_size=64)
    with pytest.raises(RuntimeError, match="--enable_lora"):
        plain.load_lora(0, str(adapters["qv"]), 0)


def test_lora_dtype_flag_resolves_to_the_stacks_dtype(tmp_path):
    """--lora_dtype: auto resolves to the activation dtype (float32 stays float32), but to bfloat16 over a GGUF base on
    a float32 CPU model; a bad value is refused naming the flag, by ServerConfig, make_config and LoraLimits alike."""
    model_dir = str(make_tiny_model("llama3", tmp_path / "base"))
    for data_type, want in [(DType.FLOAT32, DType.BFLOAT16), (DType.BFLOAT16, DType.BFLOAT16)]:
        config = resolve_config(ServerConfig(model_dir=None, device=Device.CPU, data_type=data_type, enable_lora=True))
        assert config.lora_dtype is want  # the bundled model's Q4_1 file
    assert parse_args(["--enable_lora", "--lora-dtype", "bfloat16"]).lora_dtype is DType.BFLOAT16
    assert ServerConfig(lora_dtype="float16").lora_dtype is DType.FLOAT16
    for data_type, lora_dtype, want in [(DType.FLOAT32, DType.AUTO, DType.FLOAT32),
                                        (DType.BFLOAT16, DType.AUTO, DType.BFLOAT16),
                                        (DType.FLOAT32, DType.BFLOAT16, DType.BFLOAT16)]:
        config = resolve_config(ServerConfig(model_dir=model_dir, device=Device.CPU, data_type=data_type,
                                             enable_lora=True, lora_dtype=lora_dtype))
        assert config.lora_dtype is want
    with pytest.raises(ValueError, match="--lora_dtype must be one of"):
        ServerConfig(lora_dtype="fp8")
    with pytest.raises(ValueError, match="lora_dtype: must be one of"):
        make_config(lora_dtype="int8")
    with pytest.raises(ValueError, match="--lora_dtype"):
        LoraLimits(1, 8, dtype=torch.int8)


def test_moe_family_takes_attention_adapters(tmp_path):
    """Qwen3-MoE (a dense layer among MoE ones): an adapter on q/k/v/o beside the base model in one batch."""
    base_dir = make_tiny_model("qwen3_moe", tmp_path / "base")
    adapters = {"attn": make_adapter(base_dir, tmp_path / "attn", 3, r=4, lora_alpha=6, target_modules=ALL[:4])}
    prompts = prompts_for(read_model_config(base_dir).vocab_size)[:2]
    model = load_model_dir(base_dir, torch.float32)
    attach_store(model, adapters)
    expected = [hf_greedy(hf_reference(base_dir, adapters.get(name)), prompt, 3)
                for prompt, name in zip(prompts, ("attn", None))]
    assert run_ours(model, prompts, [0, -1], 3) == expected


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    base_dir = make_tiny_model("llama3", root / "base")
    return read_model_config(base_dir), make_adapter(base_dir, root / "all", 0, r=4, lora_alpha=8,
                                                     target_modules=ALL)


def _copy(adapter: Path, tmp_path: Path, **config_changes) -> Path:
    out = tmp_path / "adapter"
    shutil.copytree(adapter, out)
    cfg_file = out / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config_changes}))
    return out


def test_read_lora_adapter_reads_the_config_and_header(llama_adapter):
    config, path = llama_adapter
    adapter = read_lora_adapter(path, config, MAX_RANK)
    assert (adapter.rank, adapter.alpha, adapter.scaling, adapter.use_rslora) == (4, 8.0, 2.0, False)
    assert adapter.target_modules == tuple(ALL)
    tensors = load_lora_tensors(adapter)
    assert len(tensors) == config.num_layers * len(ALL)
    a, b = tensors[1, "down_proj"]
    assert a.dtype == b.dtype == torch.float32
    assert a.shape == (4, config.intermediate_size) and b.shape == (config.hidden_size, 4)


def test_refuses_a_rank_above_the_max(llama_adapter):
    config, path = llama_adapter
    with pytest.raises(LoraAdapterError, match=r"adapter_config\.json.*r=4.*--max_lora_rank 2"):
        read_lora_adapter(path, config, max_rank=2)


def test_refuses_an_unknown_target_module(llama_adapter, tmp_path):
    config, path = llama_adapter
    with pytest.raises(LoraAdapterError, match="target module 'lm_head'"):
        read_lora_adapter(_copy(path, tmp_path, target_modules=["q_proj", "lm_head"]), config, MAX_RANK)


def test_refuses_a_shape_that_does_not_fit_the_base(llama_adapter):
    config, path = llama_adapter
    other = dataclasses.replace(config, num_kv_heads=1)
    with pytest.raises(LoraAdapterError, match=r"layers\.0\.self_attn\.k_proj\.lora_B\.weight.*\[32, 4\].*\[16, 4\]"):
        read_lora_adapter(path, other, MAX_RANK)


def test_refuses_a_corrupt_safetensors_file(llama_adapter, tmp_path):
    config, path = llama_adapter
    copy = _copy(path, tmp_path)
    weights = copy / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])   # data cut short
    with pytest.raises(LoraAdapterError, match=r"adapter_model\.safetensors: corrupt safetensors file"):
        read_lora_adapter(copy, config, MAX_RANK)
    weights.write_bytes(b"\xff" * 64)                  # no header at all
    with pytest.raises(LoraAdapterError, match=r"adapter_model\.safetensors: corrupt"):
        read_lora_adapter(copy, config, MAX_RANK)


def test_refuses_a_folder_without_adapter_config(llama_adapter, tmp_path):
    config, path = llama_adapter
    copy = _copy(path, tmp_path)
    (copy / "adapter_config.json").unlink()
    with pytest.raises(LoraAdapterError, match=r"adapter_config\.json: not found"):
        read_lora_adapter(copy, config, MAX_RANK)


def test_refuses_dora(llama_adapter, tmp_path):
    config, path = llama_adapter
    with pytest.raises(LoraAdapterError, match='"use_dora"'):
        read_lora_adapter(_copy(path, tmp_path, use_dora=True), config, MAX_RANK)


def test_refuses_mlp_targets_on_moe_and_any_adapter_on_mla_or_fused_families(llama_adapter):
    config, path = llama_adapter
    moe = dataclasses.replace(config, architecture="MixtralForCausalLM")
    with pytest.raises(LoraAdapterError, match="target module '(gate|up|down)_proj'.*MixtralForCausalLM"):
        read_lora_adapter(path, moe, MAX_RANK)
    for arch in ("DeepseekV3ForCausalLM", "Phi3ForCausalLM"):
        other = dataclasses.replace(config, architecture=arch)
        with pytest.raises(ValueError, match=f"--enable_lora.*{arch}"):
            LoraWeights(other, _shards(other), LoraLimits(1, MAX_RANK), "cpu")


def test_load_refuses_a_bad_slot_and_keeps_the_slot_on_a_bad_adapter(llama_adapter, tmp_path):
    config, path = llama_adapter
    store = LoraWeights(config, _shards(config), LoraLimits(1, MAX_RANK), "cpu")
    with pytest.raises(ValueError, match="slot 1 .*--max_loras is 1"):
        store.load(0, str(path), 1)
    store.load(0, str(path), 0)
    before = store.layers[0][lora_module.LoraGroup.QKV_PROJ].a.clone()
    with pytest.raises(LoraAdapterError):
        store.load(1, str(_copy(path, tmp_path, use_dora=True)), 0)
    assert torch.equal(store.layers[0][lora_module.LoraGroup.QKV_PROJ].a, before)
    assert store.slot_ids == [0] and np.all(store.targeted[:, :, 0])


def _shards(config):
    from lightserve.model_infer.weights import TPShards
    return TPShards.for_rank(config, 0, 1)


def test_a_prefetched_adapter_loads_from_the_background_read(tmp_path):
    """prefetch reads in the background; the load that follows takes that read (the folder may be gone by then), and
    its tokens are the disk load's."""
    base_dir = make_tiny_model("llama3", tmp_path / "base")
    adapter = make_adapter(base_dir, tmp_path / "a", 7, **ADAPTERS["mlp_rs"])
    model = load_model_dir(base_dir, torch.float32)
    store = LoraWeights(model.config, model.weights.shards, LoraLimits(2, 16), "cpu")
    store.prefetch(1, str(adapter))
    store._reading[1][1].result()  # the read is done
    moved = shutil.move(adapter, tmp_path / "moved")
    store.load(1, str(adapter), 0)
    shutil.move(moved, adapter)
    disk = LoraWeights(model.config, model.weights.shards, LoraLimits(2, 16), "cpu")
    disk.load(1, str(adapter), 0)
    for mine, theirs in zip(store.layers, disk.layers):
        for group in mine:
            assert torch.equal(mine[group].a, theirs[group].a) and torch.equal(mine[group].bt, theirs[group].bt)
    assert not store._reading and list(store.cache) == [1]
