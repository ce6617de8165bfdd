"""One engine step's deltas packed for the ZMQ boundary: a few flat arrays for what every delta has,
objects only for what few deltas carry (engine/messages.py OutputBatch holds one PackedDeltas).

A decode step at batch 256 is 256 deltas of one new token each; pickling 256 RequestDelta objects
with their CompletionDeltas costs the engine loop more than the step's bookkeeping. Packed, the
common part is a handful of numpy buffers (pickled as raw bytes) and one joined string:

    requests   request_ids [R], finished [R], num_cached_tokens [R]
    choices    choice_request [C] (row in requests)  choice_index [C]  routed_experts_start [C]
               token_offsets [C+1] -> token_ids [T]   text_offsets [C+1] -> text (one str)
               text_rule [C]   spans_weight_versions [C]
               version_of [C] -> versions (names), version_end [C]: the one span [0, end) a choice
               usually has; -1: its spans are in its extras
    extras     per choice row / request row, only where something is set: finish, stop reason,
               error, R3 rows, logprobs, other weight-version spans, speculative decoding counts / the
               prompt, prompt logprobs

unpack_deltas(pack_deltas(d)) == d, field for field (tests/engine/test_output_wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastdeploy_r3.logprobs import PromptLogprobs, TokenLogprob
from fastdeploy_r3.outputs import CompletionDelta, RequestDelta, SpecDecodeStats, TextRule, WeightVersionSpan


@dataclass
class ChoiceExtras:
    """What a choice's delta carries besides tokens and text: mostly its last one (the finish)."""

    finish_reason: str | None = None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_message: str | None = None
    weight_versions: list[WeightVersionSpan] | None = None  # when not one span from 0 (version_of -1)
    spec: SpecDecodeStats | None = None


@dataclass
class RequestExtras:
    """What a request's first delta (and the one that scored its prompt) carries."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    moe_layer_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class PackedDeltas:
    request_ids: list[str]
    finished: np.ndarray  # bool [R]
    num_cached_tokens: np.ndarray  # int64 [R]
    choice_request: np.ndarray  # int32 [C]
    choice_index: np.ndarray  # int32 [C]
    routed_experts_start: np.ndarray  # int64 [C]
    token_offsets: np.ndarray  # int64 [C + 1]
    token_ids: np.ndarray  # int64 [T]
    text: str
    text_offsets: np.ndarray  # int64 [C + 1], in characters
    text_rule: np.ndarray  # int8 [C]
    spans_weight_versions: np.ndarray  # bool [C]
    versions: list[str]
    version_of: np.ndarray  # int32 [C]
    version_end: np.ndarray  # int64 [C]
    choice_extras: dict[int, ChoiceExtras] = field(default_factory=dict)
    request_extras: dict[int, RequestExtras] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.request_ids)


def _choice_extras(c: CompletionDelta, one_span: bool) -> ChoiceExtras | None:
    if (c.finish_reason is None and c.stop_reason is None and c.routed_experts is None and c.error is None
            and c.logprobs is None and c.finish_message is None and one_span and c.spec is None):
        return None
    return ChoiceExtras(c.finish_reason, c.stop_reason, c.routed_experts, c.error, c.logprobs, c.finish_message,
                        None if one_span else list(c.weight_versions), c.spec)


def pack_deltas(deltas: list[RequestDelta]) -> PackedDeltas:
    choice_request: list[int] = []
    choice_index: list[int] = []
    start: list[int] = []
    token_counts: list[int] = []
    token_ids: list[int] = []
    texts: list[str] = []
    rules: list[int] = []
    spans: list[bool] = []
    version_of: list[int] = []
    version_end: list[int] = []
    versions: dict[str, int] = {}
    choice_extras: dict[int, ChoiceExtras] = {}
    request_extras: dict[int, RequestExtras] = {}
    for r, d in enumerate(deltas):
        if d.prompt is not None or d.prompt_token_ids is not None or d.moe_layer_ids is not None or (
                d.prompt_logprobs is not None):
            request_extras[r] = RequestExtras(d.prompt, d.prompt_token_ids, d.moe_layer_ids, d.prompt_logprobs)
        for c in d.outputs:
            wv = c.weight_versions
            one_span = len(wv) == 1 and wv[0].start == 0
            extras = _choice_extras(c, one_span)
            if extras is not None:
                choice_extras[len(choice_request)] = extras
            choice_request.append(r)
            choice_index.append(c.index)
            start.append(c.routed_experts_start)
            token_counts.append(len(c.token_ids))
            token_ids += c.token_ids
            texts.append(c.text)
            rules.append(c.text_rule)
            spans.append(c.spans_weight_versions)
            version_of.append(versions.setdefault(wv[0].version, len(versions)) if one_span else -1)
            version_end.append(wv[0].end if one_span else 0)
    token_offsets = np.zeros(len(token_counts) + 1, dtype=np.int64)
    np.cumsum(token_counts, out=token_offsets[1:])
    text_offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in texts], out=text_offsets[1:])
    return PackedDeltas(
        request_ids=[d.request_id for d in deltas],
        finished=np.array([d.finished for d in deltas], dtype=np.bool_),
        num_cached_tokens=np.array([d.num_cached_tokens for d in deltas], dtype=np.int64),
        choice_request=np.array(choice_request, dtype=np.int32),
        choice_index=np.array(choice_index, dtype=np.int32),
        routed_experts_start=np.array(start, dtype=np.int64),
        token_offsets=token_offsets,
        token_ids=np.array(token_ids, dtype=np.int64),
        text="".join(texts),
        text_offsets=text_offsets,
        text_rule=np.array(rules, dtype=np.int8),
        spans_weight_versions=np.array(spans, dtype=np.bool_),
        versions=list(versions),
        version_of=np.array(version_of, dtype=np.int32),
        version_end=np.array(version_end, dtype=np.int64),
        choice_extras=choice_extras,
        request_extras=request_extras,
    )


def unpack_deltas(p: PackedDeltas) -> list[RequestDelta]:
    deltas = [RequestDelta(rid, [], bool(fin), int(cached))
              for rid, fin, cached in zip(p.request_ids, p.finished.tolist(), p.num_cached_tokens.tolist())]
    for r, e in p.request_extras.items():
        d = deltas[r]
        d.prompt, d.prompt_token_ids, d.moe_layer_ids, d.prompt_logprobs = (
            e.prompt, e.prompt_token_ids, e.moe_layer_ids, e.prompt_logprobs)
    ids = p.token_ids.tolist()
    tok, txt = p.token_offsets.tolist(), p.text_offsets.tolist()
    rules = p.text_rule.tolist()
    no_extras = ChoiceExtras()
    for c, (r, index, start, spans, v, end) in enumerate(zip(
            p.choice_request.tolist(), p.choice_index.tolist(), p.routed_experts_start.tolist(),
            p.spans_weight_versions.tolist(), p.version_of.tolist(), p.version_end.tolist())):
        e = p.choice_extras.get(c, no_extras)
        wv = [WeightVersionSpan(p.versions[v], 0, end)] if v >= 0 else list(e.weight_versions or [])
        deltas[r].outputs.append(CompletionDelta(
            index=index, text=p.text[txt[c] : txt[c + 1]], token_ids=ids[tok[c] : tok[c + 1]],
            finish_reason=e.finish_reason, stop_reason=e.stop_reason, routed_experts=e.routed_experts,
            routed_experts_start=start, error=e.error, logprobs=e.logprobs, finish_message=e.finish_message,
            weight_versions=wv, spans_weight_versions=spans, text_rule=TextRule(rules[c]), spec=e.spec,
        ))
    return deltas
