"""Trainer-side helpers for Rollout Routing Replay (see docs/r3_client.md)."""

from fastdeploy_r3.client.routed_experts import read_local_rollout, read_redis_rollout, to_megatron_router_replay
from fastdeploy_r3.r3.codec import RoutedExpertsDecodeError, decode_routed_experts, encode_routed_experts

__all__ = [
    "RoutedExpertsDecodeError",
    "decode_routed_experts",
    "encode_routed_experts",
    "read_local_rollout",
    "read_redis_rollout",
    "to_megatron_router_replay",
]
