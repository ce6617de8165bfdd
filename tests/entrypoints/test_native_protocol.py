"""SGLang sampling_params map onto SamplingParams by SGLang's names and defaults; what cannot be
honoured is refused by name instead of being ignored."""

from __future__ import annotations

import pytest

from fastdeploy_r3.entrypoints.native.protocol import sglang_sampling_params
from fastdeploy_r3.sampling_params import InvalidRequestError


def test_sglang_names_and_defaults() -> None:
    p = sglang_sampling_params(
        {"max_new_tokens": 7, "temperature": 0.0, "top_k": -1, "stop": "\n", "sampling_seed": 3, "n": 2},
        return_routed_experts=True, routed_experts_start=4,
    )
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.seed, p.n) == (7, 0.0, 0, ["\n"], 3, 2)
    assert (p.return_routed_experts, p.routed_experts_start) == (True, 4)
    assert sglang_sampling_params(None, False, 0).max_tokens == 128  # SGLang's default max_new_tokens


def test_neutral_values_of_unimplemented_options_pass() -> None:
    p = sglang_sampling_params({"no_stop_trim": False, "regex": None, "spaces_between_special_tokens": True},
                               False, 0)
    assert p.max_tokens == 128


def test_what_cannot_be_honoured_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match=r"sampling_params.regex='a\+' is not supported"):
        sglang_sampling_params({"regex": "a+"}, False, 0)
    with pytest.raises(InvalidRequestError, match="unknown sampling_params key 'max_tokens'"):
        sglang_sampling_params({"max_tokens": 3}, False, 0)
    with pytest.raises(InvalidRequestError, match="max_new_tokens=0"):
        sglang_sampling_params({"max_new_tokens": 0}, False, 0)
