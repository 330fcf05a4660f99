"""A step's metadata as the kernels take it: HostStaging starts every array on a 16-byte boundary (Triton compiles a
variant per pointer alignment), make_forward_batch gives the extend requests their own aligned arrays and keeps a
host copy of the per-request metadata, and the MLA layer's prefill reads that copy: no device->host read in a
layer (a sync per layer on a GPU), the same output as from the device arrays."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightserve.config import KernelBackend
from lightserve.model_infer.forward_batch import make_forward_batch
from lightserve.model_infer.host_staging import HostStaging
from lightserve.model_infer.models import load_model, read_model_config

from .fake_worker import FakeWorker
from .tiny_models import make_tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_host_staging_aligns_every_array():
    staging = HostStaging(DEVICE)
    rng = np.random.default_rng(0)
    for _ in range(20):
        arrays = [rng.integers(-9, 9, size=int(n)).astype(np.int32) for n in rng.integers(0, 11, size=7)]
        out = staging.upload(arrays)
        assert [t.tolist() for t in out] == [a.tolist() for a in arrays]
        assert all(t.dtype == torch.int32 and t.data_ptr() % 16 == 0 for t in out)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    model_dir = make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("deepseek"))
    return load_model(read_model_config(model_dir), model_dir, torch.float32, DEVICE, backend=KernelBackend.TRITON)


def _mixed_batch(model, worker: FakeWorker):
    """A decode of row 0 (after a 3-token prompt), 4 tokens of row 1 after its first 5, and a fresh 3-token row 2."""
    worker.step([(0, [5, 6, 7]), (1, [8, 9, 10, 11, 12])], num_decode=0)
    return worker.make_batch([(0, [13]), (1, [14, 15, 16, 17]), (2, [18, 19, 20])], num_decode=1)


def test_extend_inputs_are_aligned_copies_of_the_slices(deepseek):
    batch = _mixed_batch(deepseek, FakeWorker(deepseek))
    ext, host, nd = batch.extend_inputs(), batch.host_metadata(), batch.num_decode
    assert ext.req_rows.tolist() == batch.req_rows[nd:].tolist() == [1, 2]
    assert ext.q_start_locs.tolist() == (batch.q_start_locs[nd:] - nd).tolist() == [0, 4]
    assert ext.prefix_lens.tolist() == batch.prefix_lens[nd:].tolist() == [5, 0]
    assert ext.extend_lens.tolist() == batch.extend_lens[nd:].tolist() == [4, 3]
    assert all(t.data_ptr() % 16 == 0 for t in (ext.req_rows, ext.q_start_locs, ext.prefix_lens, ext.extend_lens))
    for name in ("req_rows", "prefix_lens", "extend_lens", "q_start_locs"):
        assert getattr(host, name).tolist() == getattr(batch, name).tolist()


def test_mla_layer_reads_no_metadata_back_from_the_device(deepseek, monkeypatch):
    worker = FakeWorker(deepseek)
    batch = _mixed_batch(deepseek, worker)
    layer, cache = deepseek.mla_layers[0], worker.kv_cache.latent_caches[0]
    x = torch.randn(batch.num_tokens, deepseek.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(DEVICE)
    before = cache.clone()

    def host_read(*args, **kwargs):
        raise AssertionError("a device->host read in the layer")

    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__"):
            patch.setattr(torch.Tensor, name, host_read)
        out = layer(x, batch, cache)  # [T, hidden]
    # The same step with the metadata read back from the device arrays (a batch built without the host copy).
    cache.copy_(before)
    batch.host = None
    torch.testing.assert_close(layer(x, batch, cache), out, rtol=0, atol=0)


def test_make_forward_batch_keeps_the_plan_metadata_on_the_host(deepseek):
    worker = FakeWorker(deepseek)
    worker.step([(0, [5, 6, 7])], num_decode=0)
    plan = worker.make_plan([(0, [8]), (3, [9, 10])], num_decode=1)
    batch = make_forward_batch(plan, worker.kv_cache.req_to_token, worker.staging)
    assert batch.host is not None and batch.host.req_rows.dtype == np.int32
    assert batch.host.q_start_locs.tolist() == [0, 1] and batch.host.prefix_lens.tolist() == [3, 0]
