"""DecoderLM._logits: a float32 model's logits are the lm_head's output itself (Gemma 2's softcap applied in place,
to the same bits), many rows (a step's prompt logprobs) run through the head in chunks into one float32 output
with the same values, and a bf16 model's argmax-only step on CPU keeps the head's bf16 output."""
from __future__ import annotations

import pytest
import torch

from lightserve import kernels
from lightserve.config import KernelBackend
from lightserve.model_infer.models import load_model, read_model_config

from .tiny_models import make_tiny_model


def _recording_linear(monkeypatch) -> list[torch.Tensor]:
    outputs = []
    linear = kernels.linear

    def record(x, weight, bias=None):
        outputs.append(linear(x, weight, bias))
        return outputs[-1]
    monkeypatch.setattr(kernels, "linear", record)
    return outputs


@pytest.mark.parametrize("backend", [KernelBackend.CPU, KernelBackend.TRITON])
def test_float32_logits_are_the_heads_output_softcapped_in_place(tmp_path, monkeypatch, backend):
    model_dir = make_tiny_model("gemma2", tmp_path)
    model = load_model(read_model_config(model_dir), model_dir, torch.float32, backend=backend)
    cap = model.config.final_softcap
    assert cap > 0
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    outputs = _recording_linear(monkeypatch)
    logits = model._logits(x)
    assert len(outputs) == 1 and logits.dtype == torch.float32
    assert logits.data_ptr() == outputs[0].data_ptr()            # no copy: no float() copy, no softcap temporaries
    monkeypatch.undo()
    raw = kernels.linear(x, model.lm_head)
    assert torch.equal(logits, torch.tanh(raw / cap) * cap)       # HF's op sequence, bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_rows_run_the_head_in_chunks_with_the_same_logits(tmp_path, monkeypatch, dtype):
    model_dir = make_tiny_model("llama3", tmp_path)
    model = load_model(read_model_config(model_dir), model_dir, dtype, backend=KernelBackend.TRITON)
    x = torch.randn(10, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    whole = model._logits(x)
    outputs = _recording_linear(monkeypatch)
    chunked = model._logits(x, chunk_rows=4)
    assert chunked.dtype == whole.dtype == torch.float32 and chunked.shape == (10, model.config.vocab_size)
    # A bfloat16 head runs 4 rows at a time (no [10, V] bfloat16 copy); a float32 head's output is the logits.
    assert [t.shape[0] for t in outputs] == ([4, 4, 2] if dtype == torch.bfloat16 else [10])
    # Each chunk as the head computes those rows. A float32 head takes all 10 rows in one product, whose rows may
    # round otherwise than a 4-row product's (the GEMM's blocking depends on M: it does on an AMX Xeon), so there the
    # whole head's output is the reference, to the bit (below).
    for start in range(0, 10, 4) if dtype == torch.bfloat16 else ():
        torch.testing.assert_close(chunked[start:start + 4], model._logits(x[start:start + 4]), rtol=0, atol=0)
    torch.testing.assert_close(chunked, whole, **({} if dtype == torch.bfloat16 else {"rtol": 0, "atol": 0}))


def test_bf16_argmax_only_logits_stay_bf16_and_give_the_same_tokens(tmp_path, monkeypatch):
    """An argmax-only step of a bf16 model on CPU returns the head's own bf16 output (no float32 copy), and the
    output writer's greedy path reads it: the same tokens as from the float32 logits of a step that is not
    argmax-only, logprobs zero as no row shows one."""
    import numpy as np

    from lightserve.model_infer.sampler import greedy_host
    from lightserve.sampling import PARAMS_DTYPE, SamplingParams

    model_dir = make_tiny_model("llama3", tmp_path)
    model = load_model(read_model_config(model_dir), model_dir, torch.bfloat16, backend=KernelBackend.CPU)
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[3] = x[2]  # two rows alike
    outputs = _recording_linear(monkeypatch)
    quick = model._logits(x, argmax_only=True)
    assert quick.dtype == torch.bfloat16 and quick.data_ptr() == outputs[0].data_ptr()
    full = model._logits(x)
    assert full.dtype == torch.float32 and torch.equal(full, quick.float())
    params = np.zeros(6, PARAMS_DTYPE)
    for i in range(6):
        SamplingParams(temperature=0.0, report_logprobs=False).to_record(params[i])
    ids, logprobs = greedy_host(quick, params)
    assert np.array_equal(ids, full.argmax(-1).numpy()) and not logprobs.any()
