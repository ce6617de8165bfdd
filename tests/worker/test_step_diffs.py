"""Step messages as diffs (engine/step_builder.py -> worker/batch_state.py) give the worker exactly the
inputs that whole-state messages give, over many random schedules: requests arriving, block tables
growing, preemptions (a new table), finishes (and ids reused), retries, failed steps whose diffs the
worker never applied, chunks scheduled ahead. Both are also checked against the slot formula computed
here from the engine's own tables, and the diffs carry far fewer block ids.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fastdeploy_r3.engine.request import Request
from fastdeploy_r3.engine.scheduler import ScheduledChunk
from fastdeploy_r3.engine.step_builder import StepBuilder
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.batch_state import BatchState, BlockTableGapError
from fastdeploy_r3.worker.input_batch import InputBatcher, StepInputs
from fastdeploy_r3.worker.messages import PLACEHOLDER_TOKEN, ScheduledRequestData, StepInput

BS = 2
PROMPT_LEN = 40


class Engine:
    """The engine side of a random schedule: requests, their block tables, two step builders."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tables: dict[str, list[tuple[int, int]]] = {}  # request id -> [(block id, tag)]
        self.requests: dict[str, Request] = {}
        self.next_block = 0
        self.diff = StepBuilder(self.blocks_since, set(), diff=True)
        self.whole = StepBuilder(self.blocks_since, set(), diff=False)

    def blocks_since(self, rid: str, start: int) -> tuple[list[int], list[int]]:
        new = self.tables[rid][start:]
        return [b for b, _ in new], [t for _, t in new]

    def grow(self, rid: str, num_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * BS < num_tokens:
            self.next_block += 1
            table.append((self.next_block, self.rng.randrange(1, 10**6)))

    def add(self, rid: str) -> None:
        if rid in self.requests:
            return  # ids are unique among live requests; a finished one's id may come back
        prompt = [self.rng.randrange(0, 500) for _ in range(PROMPT_LEN)]
        self.requests[rid] = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=4))
        self.tables[rid] = []

    def preempt(self, rid: str) -> None:
        self.requests[rid].num_preemptions += 1
        self.tables[rid] = []

    def finish(self, rid: str) -> None:
        del self.requests[rid], self.tables[rid]
        for b in (self.diff, self.whole):
            b.finished(rid)

    def chunks(self) -> list[ScheduledChunk]:
        out = []
        for rid in self.rng.sample(sorted(self.requests), self.rng.randrange(1, len(self.requests) + 1)):
            req = self.requests[rid]
            if self.rng.random() < 0.15:  # a chunk scheduled ahead: feeds the token in flight
                chunk = ScheduledChunk(req, 1, start=req.num_tokens, ahead=True)
            else:
                n = self.rng.randrange(1, 5)
                chunk = ScheduledChunk(req, n, start=self.rng.randrange(0, PROMPT_LEN - n + 1))
            self.grow(rid, chunk.start + chunk.num_new_tokens + self.rng.choice([0, 0, 3]))
            out.append(chunk)
        return out


def _prepare(batcher: InputBatcher, step: StepInput) -> StepInputs:
    for rid in step.finished_request_ids:
        batcher.forget(rid)
    return batcher.prepare(step.requests)


def _expected(engine: Engine, chunks: list[ScheduledChunk]) -> dict[str, list]:
    """The inputs by the slot formula, from the engine's tables (cache_manager/slots.py)."""
    pos = [p for c in chunks for p in range(c.start, c.start + c.num_new_tokens)]
    owner = [c.request.request_id for c in chunks for _ in range(c.num_new_tokens)]
    width = max(len(engine.tables[c.request.request_id]) for c in chunks)
    return {
        "positions": pos,
        "slots": [engine.tables[r][p // BS][0] * BS + p % BS for r, p in zip(owner, pos)],
        "tags": [engine.tables[r][p // BS][1] for r, p in zip(owner, pos)],
        "tables": [[b for b, _ in engine.tables[c.request.request_id]]
                   + [0] * (width - len(engine.tables[c.request.request_id])) for c in chunks],
    }


def _same(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "tags", "block_tables", "sample_idx",
                 "seq_lens_tensor", "query_start_loc_tensor"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert [(s.row, s.request.request_id, s.position) for s in a.sample_rows] == \
        [(s.row, s.request.request_id, s.position) for s in b.sample_rows]
    assert np.array_equal(a.placeholder_rows, b.placeholder_rows)
    assert np.array_equal(a.placeholder_requests, b.placeholder_requests)


@pytest.mark.parametrize("seed", range(40))
def test_diffs_reconstruct_the_whole_state_inputs(seed: int) -> None:
    rng = random.Random(seed)
    engine = Engine(rng)
    on_diffs = InputBatcher(BS, torch.device("cpu"))
    on_whole = InputBatcher(BS, torch.device("cpu"))
    on_diffs.state = BatchState(rows=2, max_blocks=2)  # small: the arrays grow during the schedule
    sent = {"diff": 0, "whole": 0}
    checked = placeholders = 0
    for i in range(6):
        engine.add(f"r{i}")
    for _ in range(60):
        event = rng.random()
        if event < 0.1 and len(engine.requests) > 1:
            engine.finish(rng.choice(sorted(engine.requests)))
            if rng.random() < 0.5:
                engine.add(f"r{rng.randrange(0, 12)}" if rng.random() < 0.5 else f"n{rng.randrange(10**6)}")
        elif event < 0.2:
            engine.preempt(rng.choice(sorted(engine.requests)))
        elif event < 0.25:
            engine.add(f"n{rng.randrange(10**6)}")
        chunks = engine.chunks()
        retry = rng.random() < 0.1
        d, w = engine.diff.build(chunks, retry), engine.whole.build(chunks, retry)
        assert d.finished_request_ids == w.finished_request_ids
        sent["diff"] += sum(len(r.block_table) for r in d.requests)
        sent["whole"] += sum(len(r.block_table) for r in w.requests)
        if rng.random() < 0.1:
            # the step failed before the worker took it: its diffs are lost, the engine resends whole
            for b in (engine.diff, engine.whole):
                b.resend_whole(c.request.request_id for c in chunks)
            for batcher, step in ((on_diffs, d), (on_whole, w)):
                for rid in step.finished_request_ids:
                    batcher.forget(rid)
            continue
        got, want = _prepare(on_diffs, d), _prepare(on_whole, w)
        _same(got, want)
        exp = _expected(engine, chunks)
        assert got.positions.tolist() == exp["positions"]
        assert got.slot_mapping.tolist() == exp["slots"] and got.tags.tolist() == exp["tags"]
        assert got.block_tables.tolist() == exp["tables"]
        placeholders += len(got.placeholder_rows)
        assert all(got.input_ids[r] == PLACEHOLDER_TOKEN for r in got.placeholder_rows.tolist())
        checked += 1
    assert checked > 40 and placeholders > 0
    assert sent["diff"] < sent["whole"] / 2, sent  # O(changes), not O(table)


def test_a_diff_past_what_the_worker_holds_is_refused() -> None:
    """A lost diff must not be papered over: the next one names the gap (the engine resends whole)."""
    state = BatchState()
    state.apply([ScheduledRequestData("a", [1], 0, [7, 8], [70, 80], sample=False)])
    state.apply([ScheduledRequestData("a", [1], 4, [9], [90], sample=False, blocks_from=2)])
    assert state.tables[state.row_of["a"], :3].tolist() == [7, 8, 9] and state.num_blocks[state.row_of["a"]] == 3
    with pytest.raises(BlockTableGapError, match="from 5 on but this worker holds 3"):
        state.apply([ScheduledRequestData("a", [1], 10, [11], [110], sample=False, blocks_from=5)])
    # a whole table replaces the row (after a preemption: new, fewer blocks)
    state.apply([ScheduledRequestData("a", [1], 0, [4], [40], sample=False)])
    assert state.num_blocks[state.row_of["a"]] == 1 and state.tables[state.row_of["a"], 0] == 4
