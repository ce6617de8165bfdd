"""The pieces of prefill/decode disaggregation without servers: the bootstrap fields, the handoff message
and its checks, P's rooms and bootstrap server, D's fetch, and how D puts P's first token in front."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from api_server_process import free_port

from fastdeploy_r3.entrypoints.openai.errors import OpenAIError
from fastdeploy_r3.entrypoints.pd.bootstrap import BootstrapServer, Rooms, fetch_handoff
from fastdeploy_r3.entrypoints.pd.handoff import Bootstrap, Handoff, HandoffError, pd_bootstrap, prompt_digest
from fastdeploy_r3.entrypoints.pd.roles import _check_pd_params, _FirstToken
from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.outputs import CompletionDelta, RequestDelta, TextRule, WeightVersionSpan
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

PROMPT = [5, 6, 7, 8, 9]


def _handoff(**kw) -> Handoff:
    base = dict(room=42, weight_version="v1", num_prompt_tokens=len(PROMPT), prompt_digest=prompt_digest(PROMPT),
                token_id=17, text=" x", logprob=TokenLogprob(17, -0.5, 1, [(17, -0.5), (3, -1.25)]),
                finish_reason="length", num_cached_tokens=4)
    return Handoff(**{**base, **kw})


def test_bootstrap_fields_come_all_three_or_none() -> None:
    assert Bootstrap.of(None, None, None) is None
    assert Bootstrap.of("127.0.0.1", 8998, 2**64 - 1) == Bootstrap("127.0.0.1", 8998, 2**64 - 1)
    with pytest.raises(InvalidRequestError, match="bootstrap_port, bootstrap_room missing"):
        Bootstrap.of("127.0.0.1", None, None)
    with pytest.raises(InvalidRequestError, match="bootstrap_port=0"):
        Bootstrap.of("127.0.0.1", 0, 1)
    with pytest.raises(InvalidRequestError, match="bootstrap_room=-1"):
        Bootstrap.of("127.0.0.1", 1, -1)
    with pytest.raises(OpenAIError) as e:  # the serving paths' 400: one room names one request
        pd_bootstrap("127.0.0.1", 8998, 1, single=False)
    assert (e.value.status, e.value.param) == (400, "bootstrap_room")


def test_a_handoff_survives_its_json_and_a_malformed_one_is_refused() -> None:
    h = _handoff()
    assert Handoff.from_json(h.to_json()) == h
    assert Handoff.from_json(_handoff(logprob=None, stop_reason=2).to_json()).stop_reason == 2
    for bad in ({**h.to_json(), "token_id": "17"}, {**h.to_json(), "extra": 1}, {"room": 42}, [1, 2]):
        with pytest.raises(HandoffError, match="malformed handoff"):
            Handoff.from_json(bad)


def test_d_refuses_a_handoff_of_another_room_prompt_or_weight_version() -> None:
    h = _handoff()
    h.check_for(42, PROMPT, "v1")  # the one it asked for
    with pytest.raises(HandoffError, match="failed room 42: P ran out"):
        _handoff(error="P ran out").check_for(42, PROMPT, "v1")
    with pytest.raises(HandoffError, match="answered room 42 for room 43"):
        h.check_for(43, PROMPT, "v1")
    with pytest.raises(HandoffError, match="another prompt"):
        h.check_for(42, [*PROMPT[:-1], 99], "v1")  # same length, another digest
    with pytest.raises(HandoffError, match="weight_version 'v1', this decode server has 'v2'"):
        h.check_for(42, PROMPT, "v2")


def test_rooms_answer_a_waiter_the_moment_p_publishes_and_forget_what_nobody_waits_for() -> None:
    async def run() -> None:
        rooms = Rooms()
        waiter = asyncio.create_task(rooms.wait(42, 30.0))
        await asyncio.sleep(0)
        assert rooms.num_waiting() == 1
        rooms.publish(_handoff())
        assert await asyncio.wait_for(waiter, 1.0) == _handoff()
        assert await rooms.wait(7, 0.01) is None  # never published: the wait times out
        assert rooms.num_waiting() == 0  # and nothing is kept for it
        assert await rooms.wait(42, 0) == _handoff()  # a published room is asked again (a lost answer)

    asyncio.run(run())


def test_rooms_keep_at_most_max_rooms_oldest_out_first() -> None:
    rooms = Rooms(max_rooms=2)
    for room in (1, 2, 3):
        rooms.publish(_handoff(room=room))
    assert [rooms.get(r) is not None for r in (1, 2, 3)] == [False, True, True]


def test_d_long_polls_p_bootstrap_server_until_the_room_is_published() -> None:
    async def run() -> None:
        rooms = Rooms()
        server = BootstrapServer(rooms, "127.0.0.1", 0)
        try:
            loop = asyncio.get_running_loop()
            fetch = asyncio.create_task(fetch_handoff(Bootstrap("127.0.0.1", server.port, 42), loop.time() + 20))
            await asyncio.sleep(0.3)  # D asks before P is done, as the router makes it
            assert not fetch.done()
            rooms.publish(_handoff())
            assert await asyncio.wait_for(fetch, 10) == _handoff()
            with pytest.raises(HandoffError, match="did not hand over room 9 before the request's deadline"):
                await fetch_handoff(Bootstrap("127.0.0.1", server.port, 9), loop.time() + 0.3)
        finally:
            await server.close()

    asyncio.run(run())


def test_a_closed_bootstrap_port_fails_d_with_what_to_check() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(HandoffError, match="unreachable.*--disaggregation-bootstrap-port"):
            await fetch_handoff(Bootstrap("127.0.0.1", free_port(), 1), loop.time() + 30, connect_timeout_s=0.3)

    asyncio.run(run())


def test_a_taken_bootstrap_port_is_refused_by_name() -> None:
    async def run() -> None:
        first = BootstrapServer(Rooms(), "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match=f"--disaggregation-bootstrap-port {first.port}"):
                BootstrapServer(Rooms(), "127.0.0.1", first.port)
        finally:
            await first.close()

    asyncio.run(run())


def _delta(token_ids: list[int], finish: str | None = None, prompt: list[int] | None = None,
           rule: TextRule = TextRule.IN_TEXT, logprobs: list[TokenLogprob] | None = None) -> RequestDelta:
    c = CompletionDelta(0, "engine text", token_ids, finish_reason=finish, text_rule=rule, logprobs=logprobs,
                        weight_versions=[WeightVersionSpan("v1", 0, len(token_ids))])
    return RequestDelta("r", [c], finish is not None, prompt_token_ids=prompt)


def test_d_puts_p_first_token_in_front_and_leaves_the_text_to_the_receiver() -> None:
    rewrite = _FirstToken(_handoff(), PROMPT, replace=False, keep_stop_text=False)
    d_lp = TokenLogprob(23, -0.25, 1, [])
    prompt_only = rewrite(_delta([], prompt=[*PROMPT, 17]))  # D's engine ran the prompt + P's token
    assert prompt_only.prompt_token_ids == PROMPT and prompt_only.outputs[0].token_ids == []
    first = rewrite(_delta([23], logprobs=[d_lp])).outputs[0]
    assert first.token_ids == [17, 23]
    assert [lp.logprob for lp in first.logprobs] == [-0.5, -0.25]  # P's, then D's
    assert (first.text, first.text_rule) == ("", TextRule.PUSH)  # decoded again with P's token in front
    assert first.weight_versions == [WeightVersionSpan("v1", 0, 2)]  # the span counts P's token
    last = rewrite(_delta([24], finish="stop")).outputs[0]
    assert last.token_ids == [24] and last.text_rule is TextRule.PUSH_BUT_LAST_FLUSH  # a stop token: trimmed
    kept = _FirstToken(_handoff(), PROMPT, replace=False, keep_stop_text=True)
    kept(_delta([23]))
    assert kept(_delta([24], finish="stop")).outputs[0].text_rule is TextRule.PUSH_FLUSH


def test_a_first_token_that_ends_the_request_replaces_d_own() -> None:
    rewrite = _FirstToken(_handoff(finish_reason="stop", stop_reason=17, text=""), PROMPT, replace=True,
                          keep_stop_text=False)
    c = rewrite(_delta([99], finish="length", prompt=list(PROMPT), logprobs=[TokenLogprob(99, -3.0, 4, [])]))
    out = c.outputs[0]
    assert (out.token_ids, out.text, out.text_rule) == ([17], "", TextRule.IN_TEXT)
    assert (out.finish_reason, out.stop_reason) == ("stop", 17)
    assert [lp.token_id for lp in out.logprobs] == [17]


def test_what_pd_cannot_serve_like_a_colocated_server_is_refused_by_name() -> None:
    _check_pd_params(SamplingParams(max_tokens=4))
    for change, name in ((dict(n=2), "n"), (dict(stop=["x"]), "stop"), (dict(presence_penalty=0.5), "presence"),
                         (dict(frequency_penalty=0.5), "frequency"), (dict(prompt_logprobs=0), "prompt_logprobs")):
        with pytest.raises(InvalidRequestError, match=f"{name}.*--disaggregation-mode null"):
            _check_pd_params(dataclasses.replace(SamplingParams(max_tokens=4), **change))


class _FakeEngine:
    """The engine client as the roles see it: generate() yields the given deltas (then raises `fail`, if
    given); control() answers with weight version v1 and records the commands."""

    def __init__(self, deltas: list[RequestDelta], fail: BaseException | None = None) -> None:
        self.deltas, self.fail, self.commands = deltas, fail, []

    async def generate(self, request_id, prompt_token_ids, params, prompt=None, rewrite=None, keep_prompt_tail=False):
        for delta in self.deltas:
            yield delta if rewrite is None else rewrite(delta)
        if self.fail is not None:
            raise self.fail

    async def control(self, command, timeout_s=0.0):
        from fastdeploy_r3.engine.messages import ControlReply, EngineState

        self.commands.append(type(command).__name__)
        return ControlReply(0, True, "ok", EngineState("v1", None, 0))


def _prefill(deltas: list[RequestDelta], fail: BaseException | None = None, close_after: int | None = None):
    from fastdeploy_r3.entrypoints.pd.roles import PdPrefill

    async def run() -> tuple[Rooms, list[str]]:
        rooms, engine = Rooms(), _FakeEngine(deltas, fail)
        role = PdPrefill(engine, rooms, server=None)  # type: ignore[arg-type] - no bootstrap server needed
        gen = role.generate("r", PROMPT, SamplingParams(max_tokens=8, logprobs=1), None,
                            Bootstrap("127.0.0.1", 1, 42), deadline=0.0)
        seen = 0
        try:
            async for _ in gen:
                seen += 1
                if close_after is not None and seen == close_after:
                    break
        except RuntimeError:
            pass
        finally:
            await gen.aclose()
        return rooms, engine.commands

    return asyncio.run(run())


def test_p_publishes_the_first_token_only_after_the_write_through_is_done() -> None:
    lp = TokenLogprob(17, -0.5, 1, [(17, -0.5), (3, -1.25)])
    done = RequestDelta("r", [CompletionDelta(0, " x", [17], finish_reason="length", logprobs=[lp])], True,
                        num_cached_tokens=4, prompt_token_ids=PROMPT)
    rooms, commands = _prefill([done])
    assert commands == ["AwaitWriteThrough"]
    assert rooms.get(42) == _handoff(stop_reason=None)  # token, text, logprob, finish, version, digest


def test_p_publishes_an_error_when_its_request_fails_or_is_dropped_so_d_does_not_wait_out_its_deadline() -> None:
    failed = RequestDelta("r", [CompletionDelta(0, "", [], finish_reason="error", error="the step raised")], True)
    rooms, _ = _prefill([failed])
    assert rooms.get(42).error == "the step raised"
    rooms, _ = _prefill([], fail=RuntimeError("engine gone"))
    assert rooms.get(42).error == "the prefill request ended before its first token"
    pending = RequestDelta("r", [CompletionDelta(0, "", [])], False, prompt_token_ids=PROMPT)
    rooms, commands = _prefill([pending, pending], close_after=1)  # the client hung up on P
    assert rooms.get(42).error == "the prefill request ended before its first token" and commands == []


def test_p_stopping_mid_long_poll_fails_d_at_once() -> None:
    """P stopped while D waits for its room: the poll in flight is answered 503 (a killed P closes the
    connection instead, and D's next poll finds the port closed: the test above)."""

    async def run() -> None:
        rooms = Rooms()
        server = BootstrapServer(rooms, "127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        fetch = asyncio.create_task(fetch_handoff(Bootstrap("127.0.0.1", server.port, 5), loop.time() + 60,
                                                  connect_timeout_s=0.3))
        await asyncio.sleep(0.3)
        await server.close()  # uvicorn ends the long poll in flight; the port closes
        with pytest.raises(HandoffError, match="answered 503 for room 5: .*shutting down"):
            await asyncio.wait_for(fetch, 5)

    asyncio.run(run())
