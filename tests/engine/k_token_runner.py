"""A model runner that appends K tokens per request per step, as a verify step whose K - 1 drafts are
all accepted would (imported by the spawned worker ranks, so it lives in a module of its own).

After the real step it decodes K - 1 more tokens one at a time, each fed at the next position: their
KV and R3 rows go to the lookahead slots the engine reserved (WorkerReady.num_lookahead_tokens), and
the draws are those of one-token steps (the sampler's noise is a function of seed and position).

    chunk [start, start + n) ─► t0 ─ feed t0 at start + n ─► t1 ─ feed t1 ─► t2   returns [t0, t1, t2]
"""

from __future__ import annotations

from fastdeploy_r3.worker.messages import ScheduledRequestData, StepInput, StepOutput
from fastdeploy_r3.worker.model_runner import ModelRunner

K = 3


class KTokenRunner(ModelRunner):
    num_lookahead_tokens = K - 1

    def execute(self, step: StepInput) -> StepOutput:
        out = super().execute(step)
        chunks = {r.request_id: r for r in step.requests}
        for _ in range(K - 1):
            if not out.sampled_token_ids:
                break
            feed = []
            limit = self.config.model_config.max_model_len
            for rid, toks in out.sampled_token_ids.items():
                r = chunks[rid]
                pos = r.start_pos + len(r.token_ids) + len(toks) - 1  # where the newest token goes
                if limit is not None and pos >= limit - 1:
                    continue  # no lookahead slot there (scheduler._lookahead): as a verify step stops
                # the same block diff as the chunk's (applying it again changes nothing)
                feed.append(ScheduledRequestData(rid, [toks[-1]], pos, r.block_table, r.block_tags, sample=True,
                                                 blocks_from=r.blocks_from))
            if not feed:
                break
            more = super().execute(StepInput(step.step_id, feed))
            for rid, toks in more.sampled_token_ids.items():
                out.sampled_token_ids[rid] += toks
                if rid in more.logprobs:
                    out.logprobs[rid] += more.logprobs[rid]
        return out
