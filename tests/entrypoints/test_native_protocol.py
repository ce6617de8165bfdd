"""SGLang sampling_params map onto SamplingParams by SGLang's names and defaults; every field is strictly
typed; what cannot be honoured is refused by name instead of being ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fastdeploy_r3.entrypoints.native.protocol import GenerateRequest, sglang_sampling_params
from fastdeploy_r3.sampling_params import InvalidRequestError


def _params(raw: dict | None, **kw):
    return sglang_sampling_params(raw, kw.pop("r3", True), kw.pop("start", 0), **kw)


def test_sglang_names_and_defaults() -> None:
    p = _params({"max_new_tokens": 7, "temperature": 0.0, "top_k": -1, "stop": "\n", "sampling_seed": 3, "n": 2},
                start=4)
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.seed, p.n) == (7, 0.0, 0, ["\n"], 3, 2)
    assert (p.return_routed_experts, p.routed_experts_start) == (True, 4)
    assert _params(None).max_tokens == 128  # SGLang's default max_new_tokens


def test_slimes_default_body_is_honoured() -> None:
    """slime's GenerateState.sampling_params with rollout_top_p < 1 (sglang_rollout.py)."""
    p = _params({"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 64, "stop": None,
                 "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                 "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True}})
    assert p.include_stop_str_in_output and not p.spaces_between_special_tokens and not p.skip_special_tokens
    assert p.return_top_p_token_ids and p.logprobs == 0  # the kept ids ride on the logprob records


def test_the_models_generation_defaults_fill_unset_fields_as_sglang_does() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 9}
    p = _params({"top_p": 0.5}, generation_defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.5, 20, 128)


def test_what_cannot_be_honoured_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match=r"sampling_params.regex='a\+' is not supported"):
        _params({"regex": "a+"})
    with pytest.raises(InvalidRequestError, match="sampling_params.min_p=0.1 is not supported"):
        _params({"min_p": 0.1})
    with pytest.raises(InvalidRequestError, match="custom_params.temperature_schedule is not supported"):
        _params({"custom_params": {"temperature_schedule": [1, 2]}})
    with pytest.raises(InvalidRequestError, match="return_top_p_token_ids needs a truncation"):
        _params({"custom_params": {"return_top_p_token_ids": True}})  # top_p = 1: the whole vocabulary
    with pytest.raises(InvalidRequestError, match="sampling_params.max_tokens: Extra inputs are not permitted"):
        _params({"max_tokens": 3})  # the OpenAI name is not SGLang's
    with pytest.raises(InvalidRequestError, match="sampling_params.max_new_tokens: Input should be greater than"):
        _params({"max_new_tokens": 0})


@pytest.mark.parametrize("field,value", [
    ("ignore_eos", "false"), ("ignore_eos", 0), ("max_new_tokens", 2.5), ("max_new_tokens", 2.0),
    ("top_k", 2.5), ("top_k", True), ("stop_token_ids", "a"), ("stop_token_ids", [True]), ("n", "2"),
    ("temperature", "0.5"), ("temperature", float("nan")), ("skip_special_tokens", "no"),
])
def test_sampling_params_are_strictly_typed(field: str, value) -> None:
    with pytest.raises(InvalidRequestError, match=f"sampling_params.{field}"):
        _params({field: value})


@pytest.mark.parametrize("field,value", [
    ("input_ids", [True, False]), ("input_ids", [1.0, 2.0]), ("return_logprob", "yes"), ("stream", "true"),
    ("return_routed_experts", 1), ("routed_experts_start_len", -1), ("top_logprobs_num", 2.0), ("rid", 5),
])
def test_generate_fields_are_strictly_typed(field: str, value) -> None:
    with pytest.raises(ValidationError, match=field):
        GenerateRequest.model_validate({"input_ids": [1, 2], field: value})


@pytest.mark.parametrize("raw,match", [
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"temperature": 1e300}, "temperature"),
    ({"stop": ["x"] * 129}, "stop has 129 strings"),
    ({"stop": ["y" * 9000]}, "9000 characters"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_what_the_sampler_cannot_compute_finitely_or_cheaply_is_refused(raw: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        _params(raw)


def test_sglang_routers_additions_parse_with_their_defaults() -> None:
    body = GenerateRequest.model_validate({
        "input_ids": [1, 2], "model": "default", "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
        "return_indexer_topk": False,
    })
    assert body.return_routed_experts is None  # not sent: the server's --enable-return-routed-experts decides
