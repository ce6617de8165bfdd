"""An fp8 engine end to end (offline LLM, Mixtral, R3 on): it serves the published fp8 layout with prefix
hits that replay the same rows, and a trainer's bf16 update lands as the same served weights (tokens and
R3 rows) as the pre-quantized checkpoint of those weights; every new version starts a cold cache."""

from __future__ import annotations

import numpy as np
from fake_model import make_fake_model

from fastdeploy_r3.engine.llm import LLM
from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files
from fastdeploy_r3.sampling_params import SamplingParams

PROMPT = list(range(40, 75))  # two full 16-token blocks
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(llm: LLM) -> tuple[list[int], np.ndarray, int]:
    (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].routed_experts, out.num_cached_tokens


def test_an_fp8_engine_serves_and_takes_bf16_updates_as_their_quantization(tmp_path) -> None:
    ckpt = {(seed, fp8): make_fake_model("mixtral", str(tmp_path / f"s{seed}-{fp8}"), seed=seed, dtype="bfloat16",
                                         fp8=fp8) for seed in (0, 1) for fp8 in (False, True)}
    with LLM(ckpt[0, True], device="cpu", max_model_len=256, routing_replay_config={"enable_routing_replay": True}) \
            as llm:
        tokens0, r3_0, cached = _run(llm)
        assert cached == 0 and len(tokens0) == 6 and r3_0.shape == (len(PROMPT) + 5, 4, 4)  # [tokens, layers, top-k]
        again = _run(llm)
        assert (again[0], again[2]) == (tokens0, 32) and np.array_equal(again[1], r3_0)  # a prefix hit
        # the trainer pushes seed 1 in bf16: quantized on arrival
        assert llm.update_weights(dict(iter_safetensors(safetensors_files(ckpt[1, False])))) == "1"
        tokens1, r3_1, cached = _run(llm)
        assert cached == 0 and tokens1 != tokens0
        # the pre-quantized checkpoint of the same weights: the same served bytes, so the same answer
        assert llm.update_weights(ckpt[1, True], weight_version="1-fp8") == "1-fp8"
        tokens, r3, cached = _run(llm)
        assert (tokens, cached) == (tokens1, 0) and np.array_equal(r3, r3_1)
        # and back to seed 0 from its bf16 checkpoint: the fresh fp8 engine's answer
        assert llm.update_weights(ckpt[0, False], weight_version="0-again") == "0-again"
        tokens, r3, cached = _run(llm)
        assert (tokens, cached) == (tokens0, 0) and np.array_equal(r3, r3_0)
