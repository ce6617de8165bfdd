"""Bodies of the colocated-training and weight-version endpoints (SGLang's io_struct names and
defaults; miles' `selector`), strict like the rest of the native API: an unknown field is a 400."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UpdateWeightsFromTensorRequest(_Strict):
    """SGLang's UpdateWeightsFromTensorReqInput: one MultiprocessingSerializer payload per TP rank."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False
    disable_draft_model: bool | None = None
    selector: str = "all"
    force: bool = False  # this server's extension, as on the other update paths


class MemoryOccupationRequest(_Strict):
    """SGLang's Release/ResumeMemoryOccupationReqInput: tags of "kv_cache", "weights"; null = all."""

    tags: list[str] | None = None


class UpdateWeightVersionRequest(_Strict):
    new_version: str = Field(min_length=1, max_length=128)
    abort_all_requests: bool = False


class WeightsCheckerRequest(_Strict):
    """SGLang's CheckWeightsReqInput as miles sends it."""

    action: str = "checksum"
    allow_quant_error: bool = False
    selector: str = "all"
    skip_tensor_list: list[str] | None = None


class BeginWeightUpdateRequest(_Strict):
    selector: str = "all"


class EndWeightUpdateRequest(_Strict):
    pass


class PostProcessWeightsRequest(_Strict):
    """SGLang's PostProcessWeightsReqInput."""

    restore_weights_before_load: bool = False
    post_process_quantization: bool = False
    selector: str = "all"
