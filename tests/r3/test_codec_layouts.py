"""The R3 payload helpers: both wire encodings, the row arithmetic, the checks and the all_layers layout."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from fastdeploy_r3.r3.codec import (
    RoutedExpertsDecodeError,
    decode_routed_experts,
    decode_sglang_routed_experts,
    encode_routed_experts,
    encode_sglang_routed_experts,
    sglang_routed_experts_b64,
)
from fastdeploy_r3.r3.errors import debug_rows, sentinel_of
from fastdeploy_r3.r3.layouts import R3PayloadError, check_moe_rows, first_no_route, row_range, to_all_layers


def test_npy_payload_keeps_dtype_and_shape() -> None:
    rows = np.arange(12, dtype=np.uint16).reshape(2, 3, 2)
    got = decode_routed_experts(encode_routed_experts(rows))
    assert got.dtype == np.uint16 and got.tolist() == rows.tolist()


def test_sglang_payload_is_raw_int32_rows() -> None:
    """2 rows x 3 layers x K=2 as uint8 -> 48 bytes of int32, decoded only with the layer count and K."""
    rows = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)
    b64 = encode_sglang_routed_experts(rows)
    import base64

    assert len(base64.b64decode(b64)) == 2 * 3 * 2 * 4
    got = decode_sglang_routed_experts(b64, num_hidden_layers=3, top_k=2)
    assert got.dtype == np.int32 and got.tolist() == rows.tolist()
    with pytest.raises(RoutedExpertsDecodeError, match="not a multiple of one row"):
        decode_sglang_routed_experts(b64, num_hidden_layers=5, top_k=2)


def test_row_range_is_prompt_plus_returned_minus_one_with_start_capped() -> None:
    assert row_range(5, 3, 0) == (0, 7)  # P=5, N=3: rows [0, 7)
    assert row_range(5, 3, 6) == (6, 7)
    assert row_range(5, 3, 9) == (7, 7)  # a start past the end returns no rows, not negative ones


def test_checks_name_absolute_row_and_model_layer() -> None:
    rows = np.zeros((3, 2, 2), dtype=np.uint8)
    rows[2, 1, 1] = sentinel_of(np.uint8)
    assert first_no_route(rows) == (2, 1)
    with pytest.raises(R3PayloadError, match=r"row 12 layer 7 holds the no-route sentinel 255"):
        check_moe_rows(rows, [3, 7], row_offset=10)
    with pytest.raises(R3PayloadError, match=r"shape \[3, 2, 2\] uint8; expected \[4, 2, 2\]"):
        check_moe_rows(np.zeros((3, 2, 2), np.uint8), [3, 7], num_rows=4, top_k=2)
    with pytest.raises(R3PayloadError, match="is uint8; expected uint16"):
        check_moe_rows(np.zeros((3, 2, 2), np.uint8), [3, 7], dtype="uint16")
    check_moe_rows(np.full((3, 2, 2), 255, np.int32), [3, 7])  # signed arrays have no sentinel


def test_all_layers_fills_dense_layers_with_the_sentinel() -> None:
    """GLM-like: 4 hidden layers, layer 0 dense, MoE layers 1..3."""
    rows = np.array([[[1, 2], [3, 4], [5, 6]]], dtype=np.uint8)  # [1, 3, 2]
    out = to_all_layers(rows, [1, 2, 3], num_hidden_layers=4)
    assert out.shape == (1, 4, 2) and out.dtype == np.uint8
    assert out[0].tolist() == [[255, 255], [1, 2], [3, 4], [5, 6]]
    with pytest.raises(R3PayloadError, match=r"outside the model's 3 layers"):
        to_all_layers(rows, [1, 2, 3], num_hidden_layers=3)


def test_debug_rows_are_positions_mod_sentinel() -> None:
    got = debug_rows(np.array([0, 254, 255, 300]), num_layers=2, top_k=1, dtype=np.dtype(np.uint8))
    assert got[:, 0, 0].tolist() == [0, 254, 0, 45] and got.shape == (4, 2, 1)


def test_sglang_payload_is_the_base64_of_the_int32_bytes_for_every_id_range_and_length() -> None:
    """The table encoder (ids in [0, 65536)) and its fallback write exactly binascii's text of the raw
    little-endian int32 bytes: lengths not divisible by 3 (the tail groups), uint8 / uint16 / int32 rows,
    the largest 16-bit id, and ids outside the tables (negative, >= 65536)."""
    rng = np.random.default_rng(7)
    cases = [rng.integers(0, 128, size=(767, 48, 8)).astype(np.uint8),
             rng.integers(0, 1 << 16, size=(5, 3, 7)).astype(np.uint16),
             rng.integers(0, 1 << 16, size=(1, 1, 4)).astype(np.int32),
             np.full((3, 4, 8), 65535, dtype=np.uint16),
             np.array([[[7]]], dtype=np.uint8), np.array([[[7, 9]]], dtype=np.int64),
             np.zeros((0, 48, 8), dtype=np.uint8),
             np.array([[[-1, 3, 70000]]], dtype=np.int32)]  # fmt: skip
    for rows in cases:
        expected = base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")
        assert encode_sglang_routed_experts(rows) == expected, (rows.shape, rows.dtype)
        assert bytes(sglang_routed_experts_b64(rows)) == expected.encode("ascii"), (rows.shape, rows.dtype)
