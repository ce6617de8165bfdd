"""Offline LLM.update_weights: from tensors and from a checkpoint directory, afterwards the same greedy
tokens and R3 as a fresh LLM on those weights, and no prefix hit of the old version."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_r3.engine.control import EngineControlError
from fastdeploy_r3.engine.llm import LLM
from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files
from fastdeploy_r3.sampling_params import SamplingParams

PROMPT = list(range(40, 75))  # two full 16-token blocks
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
R3 = {"enable_routing_replay": True}


def _run(llm: LLM) -> tuple[list[int], np.ndarray, int]:
    (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].routed_experts, out.num_cached_tokens


def test_update_from_tensors_then_from_disk(fake_model_dir) -> None:
    old, new = fake_model_dir("mixtral", seed=0), fake_model_dir("mixtral", seed=1)
    with LLM(new, device="cpu", routing_replay_config=R3) as fresh:
        want_tokens, want_r3, _ = _run(fresh)
    with LLM(old, device="cpu", routing_replay_config=R3) as llm:
        old_tokens, old_r3, _ = _run(llm)
        assert _run(llm)[2] == 32  # the prompt's two blocks are cached under version "0"
        assert llm.update_weights(dict(iter_safetensors(safetensors_files(new)))) == "1"
        tokens, r3, cached = _run(llm)
        assert (tokens, cached) == (want_tokens, 0) and np.array_equal(r3, want_r3)
        assert tokens != old_tokens
        assert llm.update_weights(old, weight_version="back-to-seed-0") == "back-to-seed-0"
        tokens, r3, cached = _run(llm)
        assert (tokens, cached) == (old_tokens, 0) and np.array_equal(r3, old_r3)
        # the current version again: idempotent, nothing reloaded, so the cache it built stays valid
        assert llm.update_weights(old, weight_version="back-to-seed-0") == "back-to-seed-0"
        assert _run(llm)[2] == 32
        with pytest.raises(EngineControlError, match="no weight changed"):
            llm.update_weights(fake_model_dir("glm4_moe"))
        assert _run(llm)[0] == old_tokens
