"""The order in which `make test`'s pytest-xdist workers take the test files (`--dist loadfile`: a file is
one unit, handed out whole to whichever worker asks next).

xdist by default hands out the files with the most tests first, which put the one-test tool and example
runs (each 25-45 s) last, where one worker ran them alone while the other had stopped. Longest first
instead (conftest.py turns xdist's reordering off and sorts the items so): the files below in this order,
then the rest by directory. The seconds are one file's total on the 2-core CI machine (--durations, setup
included); only their order matters, so they need refreshing only when a file's time changes a lot.
"""

from __future__ import annotations

SLOW_FILES: dict[str, float] = {
    "reliability/test_fault_matrix.py": 130,
    "worker/test_expert_parallel_ep4.py": 66,
    "engine/test_cache_tiers.py": 62,
    "model_executor/test_invariant_attention.py": 51,
    "entrypoints/test_weight_update_api.py": 50,
    "model_executor/test_attention_kernels.py": 50,
    "tools/test_soak_tool.py": 47,
    "entrypoints/test_control_faults.py": 46,
    "pd/test_pd_mooncake.py": 39,
    "engine/test_llm.py": 36,
    "pd/test_pd_router.py": 35,
    "entrypoints/test_connection_limits.py": 34,
    "worker/test_expert_load.py": 32,
    "entrypoints/test_routing_store.py": 31,
    "engine/test_r3_real_routing.py": 31,
    "worker/test_expert_parallel.py": 31,
    "tools/test_r3_swap_tool.py": 31,
    "worker/test_tensor_parallel.py": 30,
    "model_executor/test_fused_moe_fp8.py": 30,
    "engine/test_storage_loads.py": 29,
    "client/test_paddle_boundary.py": 28,
    "entrypoints/test_sglang_router.py": 27,
    "pd/test_pd_mooncake_debug.py": 26,
    "entrypoints/test_generate_api.py": 26,
    "engine/test_supervision.py": 25,
    "engine/test_llm_stores.py": 25,
    "entrypoints/test_api_server.py": 24,
    "entrypoints/test_colocated_control.py": 24,
    "tools/test_bench_weight_sync.py": 24,
    "pd/test_pd_faults.py": 23,
    "entrypoints/test_server_isolation.py": 23,
    "engine/test_deterministic.py": 22,
    "engine/test_overlap.py": 22,
    "entrypoints/test_engine_client_lifetime.py": 21,
    "entrypoints/test_rollout_race.py": 21,
    "worker/test_expert_parallel_updates.py": 20,
    "worker/test_expert_rebalance.py": 19,
    "tools/test_bench_rollout.py": 18,
    "examples/test_rl_loop.py": 18,
    "engine/test_r3_property.py": 18,
    "entrypoints/test_rl_framework_replay.py": 17,
    "engine/test_spec_ngram.py": 17,
    "entrypoints/test_generate_rl_fields.py": 16,
    "entrypoints/test_api_tokens.py": 15,
    "entrypoints/test_hf_checkpoint_server.py": 15,
    "entrypoints/test_spec_server.py": 14,
}

# the files not listed: these directories' first (servers, several processes, tool runs), then the rest
LONG_DIRS = ("tools", "worker", "reliability", "pd", "examples")


def file_rank(relpath: str) -> tuple[int, float]:
    """Sort key of a test file by its path under tests/ ('/'-separated): the listed ones longest first."""
    if relpath in SLOW_FILES:
        return 0, -SLOW_FILES[relpath]
    top = relpath.split("/")[0]
    return 1, LONG_DIRS.index(top) if top in LONG_DIRS else len(LONG_DIRS)
