"""Bodies of the SGLang-compatible native API: `/generate` and the RL control endpoints.

Field names and defaults are SGLang's (`GenerateReqInput`, `sampling_params`, the weight-update
requests), so RL frameworks that drive SGLang (slime, miles, verl, OpenRLHF) and `sglang-router` in
front of it drive this server unchanged. Every field is strictly typed (no "false" for a bool, no 2.5
or 2.0 for an int, no NaN): a loosely read field is a request served otherwise than asked. Fields SGLang
has and this server cannot honour are refused with a 400 naming them, never ignored: an RL trainer
silently given other sampling than it asked for trains on the wrong distribution.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# generation_config.json's defaults that SGLang applies to requests leaving them unset
# (its --sampling-defaults model); max_new_tokens keeps SGLang's own default
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")
# custom_params keys this server implements (SGLang's custom_params reach a custom logit processor,
# which this server does not run; slime's top-p replay reads this one)
CUSTOM_PARAMS = ("return_top_p_token_ids",)


class _Strict(BaseModel):
    # unknown fields are a 400 naming them; values of the wrong JSON type are a 400, not coerced
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SglangSamplingParams(_Strict):
    """SGLang's `sampling_params`, by its names. None: SGLang's default (or the model's, see above)."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 (or 0): all
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    sampling_seed: int | None = None
    min_new_tokens: int = Field(default=0, ge=0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # keep the matched stop string, or the stop token's text, at the end of the text
    no_stop_trim: bool = False
    custom_params: dict[str, Any] | None = None
    # a chunk every this many tokens when streaming (SGLang's default: every step)
    stream_interval: int | None = Field(default=None, ge=1)
    # constrained decoding and logit bias: not run by this server, only their neutral values pass
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None


_UNSUPPORTED = {"min_p": 0.0, "regex": None, "json_schema": None, "ebnf": None, "structural_tag": None,
                "logit_bias": None}


def parse_sampling_params(raw: dict[str, Any] | None) -> SglangSamplingParams:
    """One prompt's `sampling_params` object, strictly typed; InvalidRequestError names each bad key."""
    try:
        return SglangSamplingParams.model_validate(raw or {})
    except ValidationError as e:
        raise InvalidRequestError("; ".join(
            f"sampling_params.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()
        )) from None


def sglang_sampling_params(raw: dict[str, Any] | SglangSamplingParams | None, return_routed_experts: bool | None,
                           routed_experts_start: int, generation_defaults: dict[str, Any] | None = None,
                           return_entropy: bool = False) -> SamplingParams:
    """SGLang `sampling_params` -> SamplingParams; InvalidRequestError names what cannot be honoured."""
    if not isinstance(raw, SglangSamplingParams):
        raw = parse_sampling_params(raw)
    for name, neutral in _UNSUPPORTED.items():
        if getattr(raw, name) != neutral:
            raise InvalidRequestError(f"sampling_params.{name}={getattr(raw, name)!r} is not supported by this "
                                      f"server; leave it out or send {neutral!r}")
    custom = dict(raw.custom_params or {})
    for key, value in custom.items():
        if key not in CUSTOM_PARAMS:
            raise InvalidRequestError(f"sampling_params.custom_params.{key} is not supported by this server; the "
                                      f"keys it implements: {', '.join(CUSTOM_PARAMS)}")
        if not isinstance(value, bool):
            raise InvalidRequestError(f"sampling_params.custom_params.{key}={value!r}; send true or false")
    defaults = {k: v for k, v in (generation_defaults or {}).items() if k in _MODEL_DEFAULTS}
    top_k = raw.top_k if raw.top_k is not None else defaults.get("top_k", 0)
    stop = [raw.stop] if isinstance(raw.stop, str) else list(raw.stop or [])
    return SamplingParams(
        n=raw.n,
        max_tokens=raw.max_new_tokens if raw.max_new_tokens is not None else SGLANG_DEFAULT_MAX_NEW_TOKENS,
        temperature=raw.temperature if raw.temperature is not None else defaults.get("temperature", 1.0),
        top_p=raw.top_p if raw.top_p is not None else defaults.get("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # SGLang's "all"
        seed=raw.sampling_seed,
        stop=stop,
        stop_token_ids=list(raw.stop_token_ids or []),
        ignore_eos=raw.ignore_eos,
        min_tokens=raw.min_new_tokens,
        frequency_penalty=raw.frequency_penalty,
        presence_penalty=raw.presence_penalty,
        repetition_penalty=(raw.repetition_penalty if raw.repetition_penalty is not None
                            else defaults.get("repetition_penalty", 1.0)),
        skip_special_tokens=raw.skip_special_tokens,
        spaces_between_special_tokens=raw.spaces_between_special_tokens,
        include_stop_str_in_output=raw.no_stop_trim,
        return_entropy=return_entropy,
        return_top_p_token_ids=bool(custom.get("return_top_p_token_ids", False)),
        return_routed_experts=return_routed_experts,
        routed_experts_start=routed_experts_start,
    )


class GenerateRequest(_Strict):
    """SGLang's GenerateReqInput: the fields RL rollouts (slime, miles) and sglang-router send."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None  # SglangSamplingParams each
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    # None: the server's --enable-return-routed-experts decides
    return_routed_experts: bool | None = None
    # rows [routed_experts_start_len, prompt + output - 1): a later turn's rows only
    routed_experts_start_len: int = Field(default=0, ge=0)
    # per output token, the entropy of the distribution it was sampled from (meta_info output_token_entropy)
    return_entropy: bool = False
    # sglang-router sends these with every request; SGLang's /generate serves its one model whatever
    # `model` says, and this server never logs prompts or outputs (what no_logs turns off in SGLang)
    model: str | None = None
    log_metrics: bool = True  # false: the request is left out of /metrics' request counters
    no_logs: bool = False
    # prefill/decode disaggregation (sglang-router --pd-disaggregation adds them; entrypoints/pd/)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # only false (their defaults) is served; true is refused by name (serving_generate.py says why)
    return_hidden_states: bool = False
    return_indexer_topk: bool = False
    return_bytes: bool = False
    background: bool = False
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
