"""Trainer-side decoding and Megatron layout of R3 payloads."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from fastdeploy_r3.client import (
    RoutedExpertsDecodeError,
    decode_routed_experts,
    encode_routed_experts,
    to_megatron_router_replay,
)


def test_encode_decode_round_trip_keeps_dtype_and_shape() -> None:
    for dtype in (np.uint8, np.uint16, np.int32):
        arr = np.arange(5 * 3 * 2, dtype=dtype).reshape(5, 3, 2)  # [rows, L, K]
        out = decode_routed_experts(encode_routed_experts(arr))
        assert out.dtype == dtype and np.array_equal(out, arr)


def test_decode_rejects_garbage() -> None:
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts("not base64!!")
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts(base64.b64encode(b"hello").decode())
    with pytest.raises(RoutedExpertsDecodeError):  # float arrays are not expert ids
        decode_routed_experts(encode_routed_experts(np.zeros((2, 1, 1), dtype=np.float32)))


def test_megatron_layout_pads_last_row_with_distinct_ids() -> None:
    arr = np.array([[[5, 6], [7, 1]], [[2, 3], [4, 0]]], dtype=np.uint8)  # [T-1=2, L=2, K=2]
    per_layer = to_megatron_router_replay(arr, moe_layer_ids=[1, 3])
    assert len(per_layer) == 2
    assert per_layer[0].dtype == torch.int64 and per_layer[0].tolist() == [[5, 6], [2, 3], [0, 1]]
    assert per_layer[1].tolist() == [[7, 1], [4, 0], [0, 1]]


def test_megatron_layout_refuses_sentinel_and_wrong_layers() -> None:
    arr = np.zeros((3, 2, 2), dtype=np.uint8)
    arr[1, 1, 0] = 255
    with pytest.raises(ValueError, match="row 1 layer 3"):
        to_megatron_router_replay(arr, moe_layer_ids=[1, 3])
    with pytest.raises(ValueError, match="expected"):
        to_megatron_router_replay(np.zeros((3, 2, 2), dtype=np.uint8), moe_layer_ids=[1])
