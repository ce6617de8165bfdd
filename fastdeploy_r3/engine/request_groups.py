"""User requests in flight: each fans out into one child Request per choice (n > 1), and their
progress goes back as one RequestDelta per user request.

    user request "cmpl-1", n=3 ─► children cmpl-1#0, cmpl-1#1, cmpl-1#2   (n=1: the child is cmpl-1)
    a step advances children   ─► collect({"cmpl-1"}) ─► RequestDelta(outputs=[one per child with news])

Choice i of n>1 draws with its own seed (SamplingParams.choice_seed), and only the first child scores
the prompt (prompt logprobs are the same for every choice). The first delta of a user request carries
the prompt; the last one, once every child finished, removes the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fastdeploy_r3.engine.request import Request
from fastdeploy_r3.engine.token_processor import TokenProcessor
from fastdeploy_r3.outputs import (
    CompletionDelta,
    RequestDelta,
    SpecDecodeStats,
    WeightVersionSpan,
    weight_version_spans,
)
from fastdeploy_r3.r3.layouts import row_range
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class RequestGroup:
    """A user request: one child Request per choice (n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)
    announced: bool = False  # its first delta (with the prompt) went out


class RequestGroups:
    def __init__(self, outputs: TokenProcessor, moe_layer_ids: list[int] | None) -> None:
        """moe_layer_ids: announced with each request's first delta (None without R3)."""
        self.outputs = outputs
        self.moe_layer_ids = moe_layer_ids
        self._groups: dict[str, RequestGroup] = {}
        self._child_group: dict[str, str] = {}  # child request id -> user request id

    def fan_out(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
        weight_version: str,
    ) -> RequestGroup:
        """The user request's children, registered; the caller hands them to the scheduler."""
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._groups or any(rid in self._child_group for rid in child_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight; use a unique id")
        group = RequestGroup(request_id, prompt, list(prompt_token_ids))
        for i, rid in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                # every choice scores the same prompt: the first one alone computes its logprobs
                child_params = replace(params, n=1, seed=params.choice_seed(i),
                                       prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            req = Request(rid, list(prompt_token_ids), child_params, weight_version=weight_version)
            group.children.append(req)
            self._child_group[rid] = request_id
        self._groups[request_id] = group
        return group

    def get(self, request_id: str) -> RequestGroup | None:
        return self._groups.get(request_id)

    def group_of(self, child_id: str) -> str:
        return self._child_group[child_id]

    def ids(self) -> list[str]:
        return list(self._groups)

    def groups(self) -> list[RequestGroup]:
        return list(self._groups.values())

    def __bool__(self) -> bool:
        return bool(self._groups)

    def unfinished_requests(self) -> list[Request]:
        return [req for group in self._groups.values() for req in group.children if not req.is_finished]

    def collect(self, group_ids: set[str]) -> list[RequestDelta]:
        """One delta per user request named, in id order; a finished one leaves the table."""
        deltas = []
        for gid in sorted(group_ids):
            group = self._groups.get(gid)
            if group is None:
                continue
            delta = self._make_delta(group)
            deltas.append(delta)
            if delta.finished:
                del self._groups[gid]
                for req in group.children:
                    self._child_group.pop(req.request_id, None)
                    self.outputs.forget(req.request_id)
        return deltas

    def _make_delta(self, group: RequestGroup) -> RequestDelta:
        """What is new for this request since its previous delta; the prompt goes with the first one."""
        comps = []
        all_finished = True
        for i, req in enumerate(group.children):
            finished = req.is_finished  # once: a property over the status enum, on the hot path
            all_finished = all_finished and finished
            out = self.outputs.output(req)
            if out.delta_finished:
                continue  # its finishing delta went out already
            sent = out.num_sent_tokens
            text, token_ids = self.outputs.take_delta(req)
            logprobs = None if out.logprobs is None else out.logprobs[sent : sent + len(token_ids)]
            finish_reason = None
            if finished:
                finish_reason, out.delta_finished = req.status.value, True
            comps.append(
                CompletionDelta(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=finish_reason,
                    stop_reason=out.stop_reason,
                    routed_experts=out.routed_experts if finished else None,
                    routed_experts_start=row_range(req.num_prompt_tokens, out.num_sent_tokens,
                                                   req.sampling_params.routed_experts_start)[0],
                    error=out.error,
                    logprobs=logprobs,
                    finish_message=out.finish_message,
                    weight_versions=_spans(req, out.num_sent_tokens),
                    spans_weight_versions=bool(req.weight_version_events) and req.spans_weight_versions,
                    text_rule=out.text_rule,
                    spec=(SpecDecodeStats(req.spec_verify_ct, req.spec_draft_tokens, req.spec_accepted_tokens)
                          if finished and req.spec_verify_ct else None),
                )
            )
        delta = RequestDelta(
            request_id=group.request_id,
            outputs=comps,
            finished=all_finished,
            num_cached_tokens=max(group.children[0].num_cached_tokens, 0),
        )
        first_child = group.children[0]  # every choice scores the same prompt: send the first one's
        first = self.outputs.output(first_child)
        if first.prompt_logprobs is not None and not first.prompt_logprobs_sent and (
            not first_child.needs_prompt_logprobs or first_child.is_finished
        ):
            first.prompt_logprobs_sent = True
            delta.prompt_logprobs = list(first.prompt_logprobs)
        if not group.announced:
            group.announced = True
            delta.prompt, delta.prompt_token_ids = group.prompt, group.prompt_token_ids
            delta.moe_layer_ids = None if self.moe_layer_ids is None else list(self.moe_layer_ids)
        return delta


def _spans(req: Request, num_sent_tokens: int) -> list[WeightVersionSpan]:
    """weight_version_spans of the request; without a weight update (every step but a few), one span."""
    if not req.weight_version_events:
        return [WeightVersionSpan(req.weight_version, 0, num_sent_tokens)]
    return weight_version_spans([(e.version, e.num_output_tokens) for e in req.weight_version_events],
                                req.weight_version, num_sent_tokens)


def validate_prompt(ids: list[int], params: SamplingParams, max_len: int, vocab: int) -> None:
    """Refuse a prompt the engine could not serve, saying what to change."""
    if not ids:
        raise InvalidRequestError("the prompt is empty; send at least one token")
    if len(ids) >= max_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_len}; shorten the prompt to at "
            f"most {max_len - 1} tokens or start the engine with a larger --max-model-len"
        )
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if params.routed_experts_start > len(ids) - 1:
        # rows are [start, P + N - 1): a start past the prompt's last row would skip rows the
        # trainer did not have, or ask for rows that may never exist; refused, never clamped
        raise InvalidRequestError(
            f"routed_experts_start={params.routed_experts_start} but the prompt has {len(ids)} tokens, so "
            f"its rows end at {len(ids) - 1}; use at most {len(ids) - 1} (the rows a trainer already has "
            "of an earlier turn are fewer than this turn's prompt tokens)"
        )
