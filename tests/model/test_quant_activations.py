"""What --quant_activations int8 costs in accuracy on the default model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0
embedding / lm_head, served from its GGUF), by teacher forcing against transformers' float32 forward over the same
weights dequantized (the converted folder ensure_default_model makes): the prompts prefilled (the int8 GEMM, every
projection's activations in int8), then each later token of transformers' own greedy continuation fed back one
decode step of the prompts at a time (the int8 GEMV), and each step's logits compared with transformers' at that
position (test_kv_quant_accuracy.py's loop).

Measured (Zen 3, AVX2 build; the first 2 held chat prompts, 64 positions): float32 activations top-1 1.000, mean
|dlogprob| of the chosen token 1.6e-6 (the control: the weight-only product is the dequantized weights' float32
product, up to summation order); int8 activations top-1 0.953 (3 positions of 64), |dlogprob| 0.033 (all 4 prompts,
128 positions: 0.961, 0.034). With the prompts prefilled in float32 and only the decode steps in int8 it had been
0.984 and 0.026 (0.992, 0.027). The bounds sit below those figures; a broken kernel lands near chance (top-1 ~1/V)."""
from __future__ import annotations

import pytest
import torch

from lightserve.engine.model_prep import default_gguf, prepare_gguf
from lightserve.kernels.cpu import library

from .smollm2_prompts import one_thread  # noqa: F401 (an autouse fixture)
from .test_kv_quant_accuracy import agreement, reference_continuations, teacher_forced

# (min top-1 agreement, max mean |dlogprob|) by activations
BOUNDS = {"float32": (1.0, 1e-4), "int8": (0.92, 0.05)}
NUM_PROMPTS = 2  # of the four held ones: transformers' greedy continuations are most of the test's time


@pytest.fixture(scope="module")
def smollm2_gguf():
    return prepare_gguf(default_gguf()), *reference_continuations(NUM_PROMPTS)


@pytest.mark.parametrize("activations", list(BOUNDS))
def test_default_gguf_teacher_forced_against_transformers(smollm2_gguf, activations):
    from lightserve.kernels.quant_linear import QuantLinear
    from lightserve.model_infer.models import load_model, read_model_config

    if library() is None:
        pytest.skip("no C compiler: the reference path has no int8 kernel to check")
    folder, seqs, prompt_lens, ref = smollm2_gguf
    model = load_model(read_model_config(folder), folder, torch.float32, int8_activations=activations == "int8")
    layer = model.weights.layers[0]
    assert isinstance(layer.qkv_proj, QuantLinear) and layer.qkv_proj.int8_dot == (activations == "int8")
    assert model.lm_head.int8_dot == (activations == "int8")
    ours = teacher_forced(model, seqs, prompt_lens, None)
    top1, dlogprob = agreement(ours, ref, [torch.tensor(s[n:]) for s, n in zip(seqs, prompt_lens)])
    min_top1, max_dlogprob = BOUNDS[activations]
    print(f"{activations}: top-1 {top1:.3f}, mean |dlogprob| {dlogprob:.2g} over {sum(len(o) for o in ours)}")
    assert top1 >= min_top1 and dlogprob <= max_dlogprob, (top1, dlogprob)
