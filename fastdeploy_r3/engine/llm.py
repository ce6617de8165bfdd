"""Offline batch generation: `LLM(model=DIR, **engine_kwargs).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.outputs import OutputAssembler, RequestOutput
from fastdeploy_r3.r3.delivery import R3Delivery, R3DeliveryError
from fastdeploy_r3.r3.rollout_id import RolloutIdConflictError, resolve_rollout_id, validate_rollout_id
from fastdeploy_r3.r3.stores import make_routing_store
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

# vLLM's prompt forms: text, token ids, TextPrompt {"prompt": str} and TokensPrompt
# {"prompt_token_ids": [int]} (the form verl and most RL code pass)
PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str, r3_namespace: str = "fdr3", **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        # local / p2pstore delivery: the same stores, keys and policy as the API server's
        self.routing_store = make_routing_store(self.config.routing_replay_config, r3_namespace)
        self.r3_delivery = R3Delivery(self.config.routing_replay_config, self.routing_store)
        try:
            self.engine = EngineService(self.config)
        except BaseException:
            if self.routing_store is not None:
                self.routing_store.close()
            raise
        self._ids = itertools.count()
        # request ids are the default rollout ids: unique per LLM, so two runs sharing a store never collide
        self._run_tag = uuid.uuid4().hex[:12]

    @property
    def tokenizer(self):  # noqa: ANN201 - fastdeploy_r3.engine.tokenizer.Tokenizer | None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        rollout_ids: Sequence[str] | None = None,
        overwrite_rollouts: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids":
        ids} dicts) with one SamplingParams or one per prompt; outputs come back in prompt order, each
        with its prompt_token_ids, and per-token logprobs where the params ask (`logprobs`,
        `prompt_logprobs`; definition in fastdeploy_r3/logprobs.py).

        With a `local` or `p2pstore` routing store, each finished prompt's R3 is stored under its
        rollout id (`rollout_ids[i]`, else the output's request_id) before generate() returns. As in
        the server, R3 delivery fails closed: a prompt whose R3 is missing, malformed or not stored
        comes back failed (finish_reason "error", the reason in `error`, no routed_experts).
        Rollout ids must be distinct, and are refused (RolloutIdConflictError, before anything runs)
        where the store already holds them, unless `overwrite_rollouts`.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            # as vLLM: without sampling params, sample as the model's generation_config.json says
            known = {f.name for f in dataclasses.fields(SamplingParams)}
            defaults = self.config.model_config.generation_defaults
            sampling_params = SamplingParams(**{k: v for k, v in defaults.items() if k in known})
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if rollout_ids is not None:
            rollout_ids = [validate_rollout_id(r) for r in rollout_ids]
            if len(rollout_ids) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(rollout_ids)} rollout ids")
            self._check_rollout_ids(rollout_ids, params_list, overwrite_rollouts)
        order: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                text, ids = self._tokenize(prompt)
                rid = f"offline-{self._run_tag}-{next(self._ids)}"
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
            self._deliver_r3(out, params, rollout_ids[i] if rollout_ids is not None else None, overwrite_rollouts)
        return outputs

    def update_weights(
        self,
        weights: str | os.PathLike | Mapping[str, Any] | Iterable[tuple[str, Any]],
        weight_version: str | None = None,
    ) -> str:
        """New weights in place, between generate() calls; returns the new weight_version.

        `weights`: a checkpoint directory (config.json + *.safetensors, e.g. what `save_pretrained`
        wrote), or full tensors under their HF names (a state dict, or (name, tensor) pairs; a subset is
        fine). The new version roots the prefix cache, so nothing computed by the old weights is
        reused. Raises EngineControlError (nothing changed) when the weights do not fit the model.
        """
        from fastdeploy_r3.worker.messages import UpdateWeights

        if isinstance(weights, (str, os.PathLike)):
            source = UpdateWeights(model_path=os.fspath(weights))
        else:
            items = weights.items() if isinstance(weights, Mapping) else weights
            # through the workers' pipes: plain CPU tensors
            source = UpdateWeights(tensors=[(name, t.detach().to("cpu")) for name, t in items])
        return self.engine.control.update_weights(source, weight_version, abort_all_requests=False)

    def start_expert_distribution_record(self) -> None:
        """Count, from the next step on, the (token, k) rows each MoE layer routes to each logical expert."""
        self.engine.control.expert_distribution("start")

    def stop_expert_distribution_record(self) -> None:
        self.engine.control.expert_distribution("stop")

    def dump_expert_distribution_record(self) -> list[list[int]]:
        """[L][E]: rows routed to each logical expert of each MoE layer since the start (the prompt's and
        every generated token's forward passes; padding never counts)."""
        report = self.engine.control.expert_distribution("dump")[1]
        assert report is not None
        return report.logical_count

    def rebalance_experts(self) -> list[int]:
        """EPLB from the recorded load: replicas of the hottest experts in the redundant slots, balanced over
        the ranks, weights moved between them; returns the new physical_to_logical (P/N slots per rank)."""
        return self.engine.control.rebalance_experts()[1]

    def _deliver_r3(self, out: RequestOutput, params: SamplingParams, rollout_id: str | None, overwrite: bool) -> None:
        """Check (and store) one finished prompt's R3; on failure the prompt's choices fail."""
        if not self.r3_delivery.wants(params.return_routed_experts):
            return
        if any(c.finish_reason in ("error", "abort") for c in out.outputs):
            return  # already failed (with its own reason) or aborted: nothing of it is delivered
        try:
            r3 = self.r3_delivery.deliver(out, resolve_rollout_id(rollout_id, None, out.request_id), inline=False,
                                          routing_layout=params.routing_layout, overwrite=overwrite)
        except R3DeliveryError as e:
            for c in out.outputs:
                c.finish_reason, c.error, c.routed_experts = "error", f"R3DeliveryError: {e}", None
            return
        for c, arr in zip(sorted(out.outputs, key=lambda c: c.index), r3.arrays or []):
            c.routed_experts = arr  # in the asked layout

    def _check_rollout_ids(self, rollout_ids: list[str], params_list: list[SamplingParams], overwrite: bool) -> None:
        """The server's rule, offline: one prompt per rollout id, and no silent overwrite of stored R3."""
        store = self.routing_store
        if store is None:
            return  # R3 goes back in the outputs: ids key nothing
        stored = [rid for rid, p in zip(rollout_ids, params_list, strict=True)
                  if self.r3_delivery.wants(p.return_routed_experts)]
        seen: set[str] = set()
        for rid in stored:
            if rid in seen:
                raise RolloutIdConflictError(f"rollout id {rid!r} is given twice; every prompt needs its own")
            seen.add(rid)
            if not overwrite and store.contains(rid, self.r3_delivery.moe_layer_ids):
                raise RolloutIdConflictError(f"rollout id {rid!r} already has routed_experts in the store; use "
                                             "a new id, or pass overwrite_rollouts=True to replace them")

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, list):
                    raise InvalidRequestError("prompt_token_ids must be a list of int token ids")
            elif set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    f"a dict prompt has the keys {sorted(prompt)}; use {{'prompt_token_ids': [ids]}} or "
                    "{'prompt': text}"
                )
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
