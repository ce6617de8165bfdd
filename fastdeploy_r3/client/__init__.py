"""The trainer's room: what an RL trainer imports to read R3 and push weights (docs/r3_client.md,
docs/rl_control.md).

    routed_experts.py, mooncake_rollouts.py   read stored rollouts (local, Redis, Mooncake) into arrays
    tensors.py       numpy / torch / Paddle at the boundary
    weight_sync.py   join the engine's weight-update group and broadcast new weights

It imports r3/ and distributed/ (never model_executor/, cache_manager/, engine/ or entrypoints/), so a
trainer never loads the serving stack.
"""

from fastdeploy_r3.client.mooncake_rollouts import (
    decode_fastdeploy_routing,
    read_fastdeploy_rollout,
    read_mooncake_rollout,
)
from fastdeploy_r3.client.routed_experts import (
    read_local_rollout,
    read_local_rollout_meta,
    read_redis_rollout,
    read_redis_rollout_meta,
    to_megatron_router_replay,
    to_moe_layout,
)
from fastdeploy_r3.client.tensors import as_tensor
from fastdeploy_r3.r3.codec import (
    RoutedExpertsDecodeError,
    decode_routed_experts,
    decode_sglang_routed_experts,
    encode_routed_experts,
)

__all__ = [
    "RoutedExpertsDecodeError",
    "as_tensor",
    "decode_fastdeploy_routing",
    "decode_routed_experts",
    "decode_sglang_routed_experts",
    "encode_routed_experts",
    "read_fastdeploy_rollout",
    "read_local_rollout",
    "read_mooncake_rollout",
    "read_local_rollout_meta",
    "read_redis_rollout",
    "read_redis_rollout_meta",
    "to_megatron_router_replay",
    "to_moe_layout",
]
