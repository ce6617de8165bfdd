"""How R3 rows are laid out for a reader, and the checks every delivered array passes once.

Shape legend: R = rows of a request (tokens forwarded, the last sampled one excluded, from
`routed_experts_start`), L = MoE layers (`moe_layer_ids`), H = all hidden layers, K = experts per token.

    moe          [R, L, K]   what the engine gathers; FastDeploy's readers, plus moe_layer_ids
    all_layers   [R, H, K]   dense layers filled with the sentinel; vLLM, SGLang and slime index by
                             absolute layer id
"""

from __future__ import annotations

import numpy as np

from fastdeploy_r3.r3.errors import sentinel_of


class R3PayloadError(ValueError):
    """An R3 array that cannot be the one asked for (wrong shape or dtype, or a no-route hole)."""


def row_range(num_prompt_tokens: int, num_returned_tokens: int, routed_experts_start: int) -> tuple[int, int]:
    """Rows [start, end) a request returns: end = P + N - 1 (the last token was never fed), start capped at end."""
    end = num_prompt_tokens + num_returned_tokens - 1
    return min(routed_experts_start, end), end


def first_no_route(rows: np.ndarray) -> tuple[int, int] | None:
    """(row, layer) of the first entry of rows [R, L, K] holding the sentinel of its dtype, else None.

    Signed arrays (int32 payloads of readers that widened them) have no sentinel and pass.
    """
    if rows.dtype.kind != "u" or not rows.size:
        return None
    hit = rows == sentinel_of(rows.dtype)  # [R, L, K]
    if not hit.any():  # one flat pass: the answer for every array worth delivering
        return None
    holes = np.argwhere(hit.any(axis=-1))  # [n, 2] (row, layer); a reduction over K is ~20x slower
    return int(holes[0][0]), int(holes[0][1])


def check_moe_rows(
    rows: np.ndarray,
    moe_layer_ids: list[int],
    num_rows: int | None = None,
    top_k: int | None = None,
    dtype: np.dtype | str | None = None,
    row_offset: int = 0,
    what: str = "routed_experts",
) -> None:
    """Raise R3PayloadError unless rows is [num_rows, L, top_k] of dtype with no hole (None: any).

    Messages name rows by absolute index (row_offset = routed_experts_start) and layers by model id.
    """
    want = (num_rows, len(moe_layer_ids), top_k)
    if rows.ndim != 3 or any(w is not None and w != got for w, got in zip(want, rows.shape)):
        shown = ", ".join("?" if w is None else str(w) for w in want)
        raise R3PayloadError(f"{what} has shape {list(rows.shape)} {rows.dtype}; expected [{shown}]")
    if dtype is not None and rows.dtype != np.dtype(dtype):
        raise R3PayloadError(f"{what} is {rows.dtype}; expected {np.dtype(dtype)}")
    hole = first_no_route(rows)
    if hole is not None:
        row, layer = hole
        raise R3PayloadError(
            f"{what} row {row + row_offset} layer {moe_layer_ids[layer]} holds the no-route sentinel "
            f"{sentinel_of(rows.dtype)}"
        )


def to_all_layers(rows: np.ndarray, moe_layer_ids: list[int], num_hidden_layers: int) -> np.ndarray:
    """moe [R, L, K] -> all_layers [R, H, K]: MoE layer moe_layer_ids[j] gets rows[:, j]; dense layers the sentinel."""
    if rows.ndim != 3 or rows.shape[1] != len(moe_layer_ids):
        raise R3PayloadError(f"rows have shape {list(rows.shape)}; expected [R, {len(moe_layer_ids)}, K]")
    bad = [layer for layer in moe_layer_ids if not 0 <= layer < num_hidden_layers]
    if bad:
        raise R3PayloadError(f"MoE layer ids {bad} are outside the model's {num_hidden_layers} layers")
    out = np.full((rows.shape[0], num_hidden_layers, rows.shape[2]), sentinel_of(rows.dtype), dtype=rows.dtype)
    out[:, moe_layer_ids, :] = rows  # [R, H, K]
    return out
