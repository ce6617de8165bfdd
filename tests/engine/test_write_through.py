"""The engine loop's write-through waits (engine/write_through.py) and its integrity answer
(engine/kv_integrity.py), on a fake KV manager: a prefill server's AwaitWriteThrough is answered once
the saves in flight when it arrived are done, not after later ones, and without blocking the loop."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy_r3.engine.kv_integrity import integrity_reply
from fastdeploy_r3.engine.messages import EngineState
from fastdeploy_r3.engine.write_through import WriteThroughWaits


@dataclass
class FakeSaves:
    """Saves by (connector index, save id); `finish` marks them done, as a connector's poll would."""

    in_flight: set[tuple[int, int]] = field(default_factory=set)
    done: set[tuple[int, int]] = field(default_factory=set)
    polls: list[bool] = field(default_factory=list)

    def poll_transfers(self, block: bool = False) -> None:
        self.polls.append(block)
        self.in_flight -= self.done

    def saves_in_flight(self) -> frozenset[tuple[int, int]]:
        return frozenset(self.in_flight)


def test_a_wait_is_answered_once_the_saves_in_flight_at_its_arrival_are_done_and_never_blocks() -> None:
    kv, waits = FakeSaves(in_flight={(0, 1), (0, 2)}), WriteThroughWaits()
    waits.add(7, kv)
    kv.in_flight.add((0, 3))  # submitted after the wait arrived: not waited for
    waits.add(8, kv)
    assert waits.ready(kv) == [] and waits.pending()
    kv.done = {(0, 1)}
    assert waits.ready(kv) == []
    kv.done = {(0, 1), (0, 2)}
    assert waits.ready(kv) == [7]  # (0, 3) still in flight: 8 waits on
    kv.done.add((0, 3))
    assert waits.ready(kv) == [8] and not waits.pending()
    assert kv.polls and not any(kv.polls)  # every poll was non-blocking


def test_a_wait_with_nothing_in_flight_is_answered_at_the_next_turn_of_the_loop() -> None:
    kv, waits = FakeSaves(), WriteThroughWaits()
    assert waits.ready(kv) == [] and kv.polls == []  # no wait: nothing polled
    waits.add(3, kv)
    assert waits.ready(kv) == [3]


@dataclass
class FakeGpu:
    num_blocks: int
    num_free_blocks: int


@dataclass
class FakeKv:
    gpu: FakeGpu
    broken: str | None = None

    def poll_transfers(self, block: bool = False) -> None:
        pass

    def check_integrity(self) -> None:
        if self.broken is not None:
            raise AssertionError(self.broken)


STATE = EngineState("0", None, 0)


def test_integrity_is_ok_when_the_books_agree_and_nothing_is_reserved_while_idle() -> None:
    reply = integrity_reply(FakeKv(FakeGpu(16, 16)), 1, STATE, num_requests=0)  # type: ignore[arg-type]
    assert (reply.success, reply.message) == (True, "ok")
    assert (reply.report.num_requests, reply.report.num_referenced_blocks, reply.report.num_blocks) == (0, 0, 16)
    busy = integrity_reply(FakeKv(FakeGpu(16, 10)), 2, STATE, num_requests=2)  # type: ignore[arg-type]
    assert busy.success and busy.report.num_referenced_blocks == 6


def test_integrity_fails_on_disagreeing_books_or_blocks_reserved_by_nobody() -> None:
    broken = integrity_reply(FakeKv(FakeGpu(16, 16), broken="block 3 free-list membership wrong"), 1, STATE, 0)  # type: ignore[arg-type]
    assert not broken.success and broken.message == "KV cache books disagree: block 3 free-list membership wrong"
    leaked = integrity_reply(FakeKv(FakeGpu(16, 13)), 2, STATE, num_requests=0)  # type: ignore[arg-type]
    assert not leaked.success
    assert leaked.message == "no request in flight but 3 blocks still referenced: reserved and never freed"
