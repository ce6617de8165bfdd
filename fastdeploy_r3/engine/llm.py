"""Offline batch generation: `LLM(model=DIR, **engine_kwargs).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.engine.request import RequestOutput
from fastdeploy_r3.engine.sampling_params import InvalidRequestError, SamplingParams

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self.engine = EngineService(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - fastdeploy_r3.engine.tokenizer.Tokenizer | None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        order: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                text, ids = self._tokenize(prompt)
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, ids, params, prompt=text)
                order.append(rid)
        except Exception:
            for rid in order:
                self.engine.abort_request(rid)
            self._drain()
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(order) >= 8:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Generating", unit="req")
        try:
            while len(results) < len(order):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in order]

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass prompts as lists of token ids")
            return prompt, self.engine.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("a prompt must be a string or a list of int token ids")
        return None, list(prompt)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
