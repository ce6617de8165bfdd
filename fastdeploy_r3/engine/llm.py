"""Offline batch generation: `LLM(model=DIR, **engine_kwargs).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.outputs import OutputAssembler, RequestOutput
from fastdeploy_r3.r3.delivery import R3Delivery, R3DeliveryError
from fastdeploy_r3.r3.rollout_id import resolve_rollout_id, validate_rollout_id
from fastdeploy_r3.r3.stores import make_routing_store
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str, r3_namespace: str = "fdr3", **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        # local / p2pstore delivery (DESIGN.md §7): the same stores, keys and policy as the API server's
        self.routing_store = make_routing_store(self.config.routing_replay_config, r3_namespace)
        self.r3_delivery = R3Delivery(self.config.routing_replay_config, self.routing_store)
        try:
            self.engine = EngineService(self.config)
        except BaseException:
            if self.routing_store is not None:
                self.routing_store.close()
            raise
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - fastdeploy_r3.engine.tokenizer.Tokenizer | None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        rollout_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        With a `local` or `p2pstore` routing store, each finished prompt's R3 is stored under its
        rollout id (`rollout_ids[i]`, else the output's request_id) before generate() returns. As in
        the server, R3 delivery fails closed: a prompt whose R3 is missing, malformed or not stored
        comes back failed (finish_reason "error", the reason in `error`, no routed_experts).
        """
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
        if rollout_ids is not None:
            rollout_ids = [validate_rollout_id(r) for r in rollout_ids]
            if len(rollout_ids) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(rollout_ids)} rollout ids")
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
        assemblers = {rid: OutputAssembler(rid) for rid in order}
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(order) >= 8:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Generating", unit="req")
        try:
            while len(results) < len(order):
                for delta in self.engine.step():
                    assembler = assemblers[delta.request_id]
                    assembler.add(delta)
                    if delta.finished:
                        results[delta.request_id] = assembler.output()
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        outputs = [results[rid] for rid in order]
        for i, (out, params) in enumerate(zip(outputs, params_list)):
            self._deliver_r3(out, params, rollout_ids[i] if rollout_ids is not None else None)
        return outputs

    def _deliver_r3(self, out: RequestOutput, params: SamplingParams, rollout_id: str | None) -> None:
        """Check (and store) one finished prompt's R3; on failure the prompt's choices fail."""
        if not self.r3_delivery.wants(params.return_routed_experts):
            return
        if any(c.finish_reason in ("error", "abort") for c in out.outputs):
            return  # already failed (with its own reason) or aborted: nothing of it is delivered
        try:
            self.r3_delivery.deliver(out, resolve_rollout_id(rollout_id, None, out.request_id), inline=False)
        except R3DeliveryError as e:
            for c in out.outputs:
                c.finish_reason, c.error, c.routed_experts = "error", f"R3DeliveryError: {e}", None

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
        if self.routing_store is not None:
            self.routing_store.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
