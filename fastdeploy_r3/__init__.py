"""fastdeploy_r3: a MoE serving engine with Rollout Routing Replay (R3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy_r3.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fastdeploy_r3.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing the package must not start torch work
    if name == "LLM":
        from fastdeploy_r3.engine.llm import LLM

        return LLM
    raise AttributeError(name)
