"""The KV cache in an 8-bit format (--kv_cache_dtype): its tensors and scales, the bytes a token takes, how many
tokens the worker's default sizing gives it, the checkpoint's fp8 scales, and the C decoder-layer driver over it
(bit for bit the per-kernel forward's)."""
from __future__ import annotations

import pytest
import torch

from lightserve.model_infer import model_runner
from lightserve.model_infer.kv_cache import KVCache
from lightserve.model_infer.latent_kv_cache import LatentKVCache
from lightserve.model_infer.models import read_model_config

from .fake_worker import FakeWorker
from .tiny_models import load_model_dir, make_tiny_model

QUANT = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("dtype", QUANT)
def test_cache_tensors_and_scales(dtype):
    cache = KVCache(3, 10, 2, 64, 4, 32, dtype, head_major=True, fp8_scales=[(0.5, 2.0)] * 3)
    assert cache.k.dtype == dtype and cache.k_caches[0].shape == (10, 2, 64)
    if dtype == torch.int8:
        assert all(s.shape == (10, 2) and s.dtype == torch.float32 and s.is_contiguous() for s in cache.k_scales)
        assert cache.k_scales[1].data_ptr() != cache.v_scales[1].data_ptr()
    else:
        assert cache.k_scales == [0.5] * 3 and cache.v_scales == [2.0] * 3
    latent = LatentKVCache(2, 10, 48, 4, 32, dtype)
    assert latent.latent.dtype == dtype
    assert (latent.latent_scales[0].shape == (10, 1)) if dtype == torch.int8 else latent.latent_scales == [1.0, 1.0]


def test_float_cache_has_no_scales():
    cache = KVCache(2, 8, 2, 64, 4, 32, torch.bfloat16)
    assert cache.k_scales == [None, None] and cache.v_scales == [None, None]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_cpu_pool_is_resident_only_where_written(dtype):
    """The CPU pool's zeros are the OS's zero pages (kv_cache.lazy_zeros): K and V of SmolLM2's shape at 16,384
    tokens (720 MiB in float32, 191 MiB in int8 with its scales) read as zeros and add to the process's RSS only for
    the rows written."""
    before = _rss_bytes()
    cache = KVCache(30, 16384, 3, 64, 4, 32, dtype)
    layer = cache.k_caches[7]
    assert layer.shape == (16384, 3, 64) and not layer.any() and not cache.v_caches[29].any()
    if dtype == torch.int8:
        assert not cache.k_scales[7].any()
    layer[100:116] = 3
    cache.v_caches[0][5] = 1
    assert int(cache.k[7, 100:116].sum()) == 16 * 3 * 64 * 3 and int(cache.k.sum()) == 16 * 3 * 64 * 3
    assert int(cache.v.sum()) == 3 * 64
    assert _rss_bytes() - before < 64 << 20, "the pool became resident without being written"


def test_an_explicit_cpu_pool_larger_than_memory_is_refused(monkeypatch):
    """A pool that is resident only as written must still fit: --max_total_token_num past the memory available is a
    start-up error naming the flag, not a worker killed under load."""
    monkeypatch.setattr(model_runner, "memory_bytes", lambda: 1 << 30)
    model_runner._check_cpu_kv_fits(20000, 46080, 1)  # 879 MiB
    with pytest.raises(ValueError, match=r"--max_total_token_num 30000: the KV cache needs 1318 MiB \(46080 bytes"):
        model_runner._check_cpu_kv_fits(30000, 46080, 1)
    with pytest.raises(ValueError, match="on each of 2 ranks"):
        model_runner._check_cpu_kv_fits(20000, 46080, 2)


def test_bytes_per_token_and_default_sizing(tmp_path, monkeypatch):
    """SmolLM2's shape (30 layers, 3 KV heads x 64): 23,040 bytes a token in bf16, 12,240 in int8 (its scales
    included), 11,520 in fp8; under the default cap (CPU_KV_DEFAULT_MAX tokens of the activation dtype) an int8
    cache gets 1.88x the tokens, fp8 2x."""
    model_dir = make_tiny_model("llama3", tmp_path / "m", num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, hidden_size=576)
    config = read_model_config(model_dir)
    per_token = {dt: KVCache.bytes_per_token(config, 3, dt) for dt in (torch.bfloat16, torch.float32, *QUANT)}
    assert per_token == {torch.bfloat16: 23040, torch.float32: 46080, torch.int8: 12240, torch.float8_e4m3fn: 11520,
                         torch.float8_e5m2: 11520}
    monkeypatch.setattr(model_runner, "memory_bytes", lambda: 1 << 40)  # the cap, not the memory, decides
    bf16 = model_runner._cpu_kv_size(per_token[torch.bfloat16], 1, per_token[torch.bfloat16])
    int8 = model_runner._cpu_kv_size(per_token[torch.int8], 1, per_token[torch.bfloat16])
    fp8 = model_runner._cpu_kv_size(per_token[torch.float8_e4m3fn], 1, per_token[torch.bfloat16])
    assert bf16 == model_runner.CPU_KV_DEFAULT_MAX
    assert int8 == bf16 * 23040 // 12240 and fp8 == 2 * bf16
    monkeypatch.setattr(model_runner, "memory_bytes", lambda: 1 << 30)  # now memory decides: bytes, not tokens
    assert model_runner._cpu_kv_size(per_token[torch.int8], 1, per_token[torch.bfloat16]) == \
        int((1 << 30) * model_runner.CPU_KV_MEMORY_FRACTION // 12240)


def test_checkpoint_fp8_scales_reach_the_cache(tmp_path):
    """`model.layers.N.self_attn.k_scale` / `v_scale` in the checkpoint become the fp8 cache's per-layer scales;
    an int8 or float cache ignores them."""
    from safetensors.torch import save_file

    model_dir = make_tiny_model("llama3", tmp_path / "m")
    save_file({f"model.layers.{i}.self_attn.{n}": torch.tensor([0.25 * (i + 1) + (n == "v_scale")])
               for i in range(2) for n in ("k_scale", "v_scale")}, str(model_dir / "scales.safetensors"))
    model = load_model_dir(model_dir, torch.float32)
    assert model.weights.kv_scales == [(0.25, 1.25), (0.5, 1.5)]
    cache = model.make_kv_cache(16, 2, 32, torch.float8_e4m3fn)
    assert cache.k_scales == [0.25, 0.5] and cache.v_scales == [1.25, 1.5]
    assert model.make_kv_cache(16, 2, 32, torch.int8).k_scales[0].shape == (16, 2)


def run_one_call_and_loop(tmp_path, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[list, list]:
    """The same three steps (a prefill, a decode step, a mixed step with a prefix hit) through the C decoder-layer
    driver and through the per-kernel forward, each over its own cache of kv_dtype: (their logits, their workers).
    head_dim 64, so both take the C attention."""
    model_dir = make_tiny_model("llama3", tmp_path / "m", hidden_size=128, num_attention_heads=2,
                                num_key_value_heads=1)
    fused, split = load_model_dir(model_dir, dtype), load_model_dir(model_dir, dtype)
    if fused.cpu_layers is None:
        pytest.fail("the one-call driver does not take this tiny model here")
    split.cpu_layers = None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 160, (n,), generator=gen).tolist() for n in (11, 5)]
    workers = [FakeWorker(m, num_kv_rows=128, num_req_rows=4, max_len=64, kv_dtype=kv_dtype) for m in (fused, split)]
    outs = [[], []]
    for w, out in zip(workers, outs):
        out.append(w.step(list(enumerate(prompts)), num_decode=0))
        out.append(w.step([(0, [7]), (1, [9])], num_decode=2))
        w.share_prefix(2, 0, 8)
        out.append(w.step([(0, [4]), (2, [5, 6, 8])], num_decode=1))
    return outs, workers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", QUANT, ids=["int8", "e4m3", "e5m2"])
def test_one_call_layers_over_an_8bit_cache_match_the_per_kernel_forward(tmp_path, dtype, kv_dtype):
    """The C decoder-layer driver (models/llama.py's one call) writes and reads the 8-bit cache as the per-kernel
    forward does: the same logits bit for bit, and the same cache bytes and scales."""
    outs, workers = run_one_call_and_loop(tmp_path, dtype, kv_dtype)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    fc, sc = workers[0].kv_cache, workers[1].kv_cache
    assert torch.equal(fc.k.view(torch.uint8), sc.k.view(torch.uint8))
    assert torch.equal(fc.v.view(torch.uint8), sc.v.view(torch.uint8))
    if kv_dtype == torch.int8:
        assert all(torch.equal(a, b) for a, b in zip(fc.k_scales + fc.v_scales, sc.k_scales + sc.v_scales))


def test_one_call_layers_over_a_bf16_cache_under_float32_activations(tmp_path):
    """Float32 activations over a bf16 cache (--data_type float32 --kv_cache_dtype bfloat16, half the bytes a
    token): the driver rounds the rows as it writes them (store_kv, to nearest even as .to(torch.bfloat16)) and its
    attention widens them, bit for bit the per-kernel forward; the logits stay within bf16's rounding of the float32
    cache's."""
    outs, workers = run_one_call_and_loop(tmp_path, torch.float32, torch.bfloat16)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    fc, sc = workers[0].kv_cache, workers[1].kv_cache
    assert fc.k.dtype == torch.bfloat16 and torch.equal(fc.k, sc.k) and torch.equal(fc.v, sc.v)
    wide, _ = run_one_call_and_loop(tmp_path / "f32", torch.float32, torch.float32)
    for a, b in zip(outs[0], wide[0]):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.1)  # a misread row would be off by O(1)
        assert not torch.equal(a, b)
