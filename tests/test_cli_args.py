"""Engine flags come from the config dataclass fields: one flag per flag() field, typed from its
annotation; derived fields are neither flags nor constructor arguments."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from fastdeploy_r3.config import ConfigError, EngineConfig, ModelConfig
from fastdeploy_r3.config.cli import add_engine_args, engine_config_from_args
from fastdeploy_r3.r3.config import RoutingReplayConfig


def parser() -> argparse.ArgumentParser:
    return add_engine_args(argparse.ArgumentParser())


def test_every_flag_field_is_a_flag_and_nothing_else_is() -> None:
    flags = [a.option_strings[0] for a in parser()._actions if a.dest != "help"]
    assert flags == [
        "--model", "--dtype", "--quantization", "--load-format", "--max-model-len", "--seed", "--weight-version",
        "--enforce-eager", "--enable-deterministic-inference", "--block-size", "--num-gpu-blocks-override",
        "--gpu-memory-utilization",
        "--kv-cache-space-gib", "--kv-cache-dtype", "--enable-prefix-caching", "--swap-space",
        "--num-cpu-blocks-override", "--kv-storage",
        "--kv-storage-ttl-s", "--kv-storage-capacity-gib", "--storage-timeout-s", "--transfer-timeout-s",
        "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill", "--disable-overlap-schedule",
        "--max-waiting-requests",
        "--tensor-parallel-size", "--worker-step-timeout-s", "--enable-expert-parallel", "--ep-size",
        "--expert-placement-file", "--ep-num-redundant-experts", "--moe-a2a-backend",
        "--routing-replay-config", "--device",
        "--speculative-config",
        # SGLang's spellings of --speculative-config (config/cli.py adds them by hand)
        "--speculative-algorithm", "--speculative-num-draft-tokens", "--speculative-ngram-min-match-window-size",
        "--speculative-ngram-max-match-window-size", "--speculative-num-steps", "--speculative-eagle-topk",
    ]


def test_defaults_types_and_choices_follow_the_fields() -> None:
    args = parser().parse_args(["--model", "m", "--block-size", "8", "--swap-space", "0.5",
                                "--no-enable-prefix-caching"])
    assert (args.block_size, args.swap_space, args.enable_prefix_caching) == (8, 0.5, False)
    assert (args.quantization, args.kv_cache_dtype) == ("none", "auto")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser().parse_args(["--model", "m", "--quantization", "int8"])
    ep = parser().parse_args(["--model", "m", "--tensor-parallel-size", "2", "--enable-expert-parallel",
                              "--ep-size", "2"])
    assert (ep.tensor_parallel_size, ep.enable_expert_parallel, ep.ep_size) == (2, True, 2)
    assert (ep.moe_a2a_backend, parser().parse_args(["--model", "m", "--moe-a2a-backend", "alltoall"]).moe_a2a_backend
            ) == ("local", "alltoall")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parser().parse_args(["--model", "m", "--moe-a2a-backend", "deepep"])
    assert parser().parse_args(["--model", "m", "--quantization", "fp8"]).quantization == "fp8"
    assert (args.max_model_len, args.dtype, args.max_num_seqs) == (None, "float32", None)  # None: the device decides
    assert args.routing_replay_config is None
    with pytest.raises(SystemExit):
        parser().parse_args(["--model", "m", "--dtype", "float64"])  # choices=MODEL_DTYPES
    with pytest.raises(SystemExit):
        parser().parse_args(["--block-size", "8"])  # --model is required


def test_flags_build_the_engine_config(fake_model_dir: Callable[..., str]) -> None:
    args = parser().parse_args([
        "--model", fake_model_dir("qwen3_moe"), "--block-size", "8", "--max-model-len", "64", "--device", "cpu",
        "--routing-replay-config", '{"enable_routing_replay": true}', "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", "64",
    ])
    cfg = engine_config_from_args(args)
    assert cfg.cache_config.block_size == 8 and cfg.max_model_len == 64
    assert cfg.scheduler_config.enable_chunked_prefill is False and cfg.device == "cpu"
    assert cfg.routing_replay_config.enable_routing_replay and cfg.routing_replay_config.moe_top_k > 0


def test_derived_fields_are_not_constructor_arguments(fake_model_dir: Callable[..., str]) -> None:
    with pytest.raises(TypeError, match="num_experts"):
        ModelConfig(model="m", num_experts=8)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="moe_top_k"):
        RoutingReplayConfig(moe_top_k=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="unknown routing replay key.*moe_layer_ids"):
        RoutingReplayConfig.from_json({"moe_layer_ids": [1]})
    with pytest.raises(ConfigError, match="unknown engine argument 'hf_config'"):
        EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), hf_config={})


def test_only_a_mooncake_decode_server_readies_its_ctm_for_prefill_servers_writes(fake_model_dir) -> None:
    """The API server's PD flags set the engine field no flag of its own sets (CacheConfig.pd_receiver)."""
    from fastdeploy_r3.entrypoints.openai.api_server import make_arg_parser
    from fastdeploy_r3.entrypoints.pd.roles import pd_engine_fields

    base = ["--model", fake_model_dir("qwen3_moe"), "--device", "cpu", "--kv-storage", "file:///tmp/fdr3_cli_test"]
    for mode, backend, want in (("decode", "mooncake", True), ("decode", "store", False),
                                ("prefill", "mooncake", False), ("null", "store", False)):
        args = make_arg_parser().parse_args([*base, "--disaggregation-mode", mode,
                                         "--disaggregation-transfer-backend", backend])
        assert engine_config_from_args(args, **pd_engine_fields(args)).cache_config.pd_receiver is want, (mode, backend)
