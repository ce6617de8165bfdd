"""Bodies of the SGLang-compatible native API: `/generate` and the RL control endpoints.

Field names and defaults are SGLang's (`GenerateReqInput`, `sampling_params`, the weight-update
requests), so RL frameworks that drive SGLang (slime, verl, OpenRLHF) drive this server unchanged.
Fields SGLang has and this server cannot honour are refused with a 400 naming them, never ignored:
an RL trainer silently given other sampling than it asked for trains on the wrong distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128

# SGLang sampling_params name -> SamplingParams field. Penalties, min_new_tokens and
# skip_special_tokens map onto the vLLM/OpenAI names when SamplingParams has them.
_SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "sampling_seed": "seed",
    "min_new_tokens": "min_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "skip_special_tokens": "skip_special_tokens",
    "min_p": "min_p",
}
# SGLang's neutral value of each option: sending it is fine even where the option is not implemented
_NEUTRAL: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "min_p": 0.0,
    "no_stop_trim": False,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stream_interval": None,
}


def sglang_sampling_params(raw: dict[str, Any] | None, return_routed_experts: bool, routed_experts_start: int,
                           ) -> SamplingParams:
    """SGLang `sampling_params` -> SamplingParams; InvalidRequestError names what cannot be honoured."""
    raw = dict(raw or {})
    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    kwargs: dict[str, Any] = {"max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS}
    for key, value in raw.items():
        target = _SAMPLING_NAMES.get(key)
        if target is not None and target in ours:
            if value is not None:
                kwargs[target] = value
        elif key in _NEUTRAL or key in _SAMPLING_NAMES:
            if value != _NEUTRAL.get(key):
                raise InvalidRequestError(
                    f"sampling_params.{key}={value!r} is not supported by this server; leave it out or send "
                    f"{_NEUTRAL.get(key)!r}"
                )
        else:
            raise InvalidRequestError(f"unknown sampling_params key {key!r}; SGLang's names are expected "
                                      "(max_new_tokens, temperature, top_p, top_k, stop, ...)")
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # SGLang's "disabled"
    if kwargs["max_tokens"] == 0:
        raise InvalidRequestError("sampling_params.max_new_tokens=0 (prefill only) is not supported; ask for >= 1")
    kwargs["return_routed_experts"] = return_routed_experts
    kwargs["routed_experts_start"] = routed_experts_start
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:  # a value of the wrong type
        raise InvalidRequestError(f"sampling_params: {e}") from e


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Strict):
    """SGLang's GenerateReqInput, the fields an RL rollout uses."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(default=0, ge=0)
    # present in SGLang clients' payloads; only their neutral values are accepted
    lora_path: str | list[str | None] | None = None
    image_data: Any = None
    session_params: dict[str, Any] | None = None


class PauseGenerationRequest(_Strict):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class ContinueGenerationRequest(_Strict):
    torch_empty_cache: bool = True  # SGLang's knob; nothing to empty on this engine's CPU path


class AbortRequestBody(_Strict):
    rid: str = ""
    abort_all: bool = False


class _WeightUpdateCommon(_Strict):
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    torch_empty_cache: bool = False
    # this server's extension: reload although weight_version is the current one (else 200, nothing reloaded)
    force: bool = False


class UpdateWeightsFromDiskRequest(_WeightUpdateCommon):
    model_path: str
    load_format: str | None = None


class InitWeightsUpdateGroupRequest(_Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateWeightsFromDistributedRequest(_WeightUpdateCommon):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    load_format: str | None = None
    selector: str = "all"  # miles: which of the engine's models takes the update (entrypoints/native/control_api.py)


class DestroyWeightsUpdateGroupRequest(_Strict):
    group_name: str = "weight_update_group"
