"""Pure checks, no processes: how the pipeline tells a prompt, a chat and a list apart, and how
pipeline() turns keyword settings into a ServerConfig."""
from __future__ import annotations

import pytest

from lightserve.cli import make_config
from lightserve.config import AdmissionPolicy, Device, DType
from lightserve.pipeline import _split_prompts

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("prompts, expected, single", [
    ("hello", ["hello"], True),
    (CHAT, [CHAT], True),
    (tuple(CHAT), [CHAT], True),
    (["a", "b"], ["a", "b"], False),
    ([CHAT, CHAT], [CHAT, CHAT], False),
    (["a", CHAT], ["a", CHAT], False),
    ([], [], False),
])
def test_prompt_forms(prompts, expected, single):
    assert _split_prompts(prompts) == (expected, single)


@pytest.mark.parametrize("bad", [[CHAT[0], "a"], [1, 2], {"role": "user", "content": "x"}, ["a", []], None, b"x"])
def test_refused_prompt_forms(bad):
    with pytest.raises(TypeError, match="prompts must be"):
        _split_prompts(bad)


def test_settings_accept_enum_strings_and_name_bad_ones():
    config = make_config("/models/x", device="CPU", data_type="float32", admission_policy="conservative", tp=1)
    assert (config.device, config.data_type, config.admission_policy) == (Device.CPU, DType.FLOAT32,
                                                                          AdmissionPolicy.CONSERVATIVE)
    assert config.model_dir == "/models/x" and config.log_level == "warning"
    assert make_config(device=Device.CUDA, log_level="info").device is Device.CUDA
    with pytest.raises(TypeError, match="unknown setting 'bogus'"):
        make_config(bogus=1)
    with pytest.raises(ValueError, match="data_type: must be one of"):
        make_config(data_type="float64")
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        make_config(tp=0)
