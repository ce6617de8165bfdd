"""FP8 dense linear on the GPU (ops/fused_moe_triton.py's expert GEMM run as one expert that every row goes
to). Weight-only, for float32 activations: y = x @ dequantize(W)^T with W's fp8 tiles dequantised as they
are loaded.

    x [M, I] (bf16 / fp16 / float32)   W [O, I] float8_e4m3fn   scale rows [O, ceil(I/128)] float32
    one program: BLOCK_M rows x BLOCK_N outputs, K loop in BLOCK_K steps (BLOCK_K divides 128, so a
    tile needs one scale column); each fp8 tile x its scale, rounded once to x's dtype, then the MMA

Before this, Fp8LinearMethod dequantised every dense weight into a bf16 copy on each forward (three
elementwise kernels per linear): on the H200 an fp8 Qwen3-30B-A3B decode step at batch 1 took 12.98 ms
against 6.04 ms in bf16, half of it those copies. The result is the same arithmetic as dequantize()
then a matmul, up to the summation order inside the MMA (float32 accumulation either way).

With 16-bit activations the linear is W8A8 instead, whatever the number of rows: x quantized per row and
128-wide group (ops/fp8_quant.py, as the published fp8 checkpoints' "activation_scheme": "dynamic"),
each K step one fp8 MMA scaled by both scales; its result is then that of the dequantised activations,
not of x itself (relative L2 ~2e-3 against them on the H200, tests/gpu/test_fp8_w8a8_gpu.py). A row's
codes depend on that row only, so its result keeps its arithmetic whatever rows share the launch, up to
the float32 summation order of a split launch (split_k below) (a switch between weight-only and W8A8 at a
row count changed the routing of a prompt tail recomputed after a prefix hit); weight-only stays for
float32 activations.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.arrivals import arrival_counters
from fastdeploy_r3.model_executor.ops.fused_moe_triton import _expert_gemm_kernel, fp8_operand
from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, num_sms, require_triton, triton

MAX_ROWS = 4096  # longer prefill chunks: a dequantised copy and cuBLAS (o at 8192 rows: 12.3 ms / 48 layers
# against 15.1 for W8A8; qkv 15.7 against 15.1; at 2048 rows W8A8 wins 3.7-3.9 against 5.3-6.8)


# W8A8 launches of up to SPLIT_K_MAX_ROWS rows (a verify step's 2-8 tokens) split the reduction over K when their
# tiles alone cover the GPU less than SPLIT_K_PROGRAMS times an SM: at 4 rows o 4096 -> 2048 is 128 programs of
# 32 K steps on 132 SMs. Each split sums its K chunk in order and the last of a tile's splits to land adds the
# chunks in split order (ops/arrivals.py): the same bits whichever lands last, the float32 sum regrouped by
# chunk (like the one-row GEMV, ops/fp8_gemv.py, a row agrees with the unsplit launch to float32 rounding).
SPLIT_K_MAX_ROWS = 16
SPLIT_K_PROGRAMS = 4  # per SM; 0: never split
SPLIT_K_MIN_STEPS = 4  # BLOCK_K steps a split sums at least


def split_k(rows: int, programs: int, k_steps: int, device: torch.device) -> int:
    """How many K chunks a W8A8 launch of `programs` (row, column) tiles and `k_steps` BLOCK_K steps splits into."""
    if rows > SPLIT_K_MAX_ROWS or not SPLIT_K_PROGRAMS:
        return 1
    want = -(-SPLIT_K_PROGRAMS * num_sms(device) // programs)
    return max(1, min(want, k_steps // SPLIT_K_MIN_STEPS))


def _tiles(rows: int, out_features: int, fp8_activations: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), from tools/bench_fp8.py on the H200 (Qwen3-30B-A3B's
    qkv 2048 -> 5120 and o 4096 -> 2048, 48 layers). Decode rows stream the weight: narrow BLOCK_N for
    enough programs, 8 stages to keep loads in flight (1 row: qkv 0.42 ms, o 0.50, against 0.47 and 0.72 at
    3 stages; cuBLAS bf16 0.38 / 0.45). W8A8 takes one 128-wide scale group a K step (64 rows: 0.55 / 0.77
    against 0.87 / 1.24 weight-only; 256: 0.87 / 0.94 against 1.60 / 2.16)."""
    if fp8_activations:
        if rows <= 16:  # 1 row: qkv 0.47 ms, o 0.61 (weight-only 0.42 / 0.50; cuBLAS bf16 0.38 / 0.45)
            return 16, 16, 128, 2, 8
        if rows <= 64:
            return (64, 64, 128, 4, 4) if out_features >= 4096 else (16, 64, 128, 4, 4)
        if rows <= 256:
            return (64, 128, 128, 4, 3) if out_features >= 4096 else (64, 64, 128, 4, 4)
        return 64, 128, 128, 4, 3
    if rows <= 16:
        return 16, 16, 128, 2, 8
    if rows <= 64:
        return 64, 64, 128, 4, 3
    return 64, 128, 64, 4, 3


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
               tiles: tuple[int, int, int, int, int] | None = None, fp8_activations: bool | None = None,
               ) -> torch.Tensor:  # fmt: skip
    """x [M, I] @ dequantize(weight [O, I] fp8, scale_rows [O, ceil(I/128)])^T -> [M, O] in x.dtype.

    tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) instead of _tiles' pick (tools/bench_fp8.py).
    fp8_activations: W8A8, x quantized per row and 128-wide group first (ops/fp8_quant.py), then fp8 MMAs:
    y = dequantize(x's codes, their scales) @ dequantize(W)^T up to the float32 summation order, rounded
    to x.dtype. None: W8A8 for 16-bit x, weight-only for float32."""
    require_triton("fp8_linear")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1 or scale_rows.stride(1) != 1:
        raise ValueError("fp8_linear: the weight and its scale rows must be contiguous in their last dimension")
    if fp8_activations is None:
        fp8_activations = x.dtype != torch.float32
    block_m, block_n, block_k, warps, stages = tiles or _tiles(rows, out_features, fp8_activations)
    if 128 % block_k:
        raise ValueError(f"fp8_linear: BLOCK_K {block_k} must divide 128 (one scale column a tile)")
    w8a8 = fp8_operand(x if fp8_activations else None)  # x's codes and group scales, else {}
    a = w8a8.pop("a", x)
    grid_m, grid_n = triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n)
    k_steps = triton.cdiv(in_features, block_k)
    splits = split_k(rows, grid_m * grid_n, k_steps, x.device) if fp8_activations and tiles is None else 1
    arrivals = arrival_counters(x.device, grid_m * grid_n) if splits > 1 else None
    if arrivals is not None:  # k_chunk: whole BLOCK_K steps, the last split maybe shorter, none empty
        k_chunk = -(-k_steps // splits) * block_k
        splits = -(-in_features // k_chunk)
        w8a8 |= {"part_ptr": torch.empty(splits, rows, out_features, dtype=torch.float32, device=x.device),
                 "arrivals_ptr": arrivals, "k_chunk": k_chunk, "SPLIT_K": splits}
    # DENSE: row r of the tile is x's row r (no routing metadata, nothing for a CUDA graph to keep)
    _expert_gemm_kernel[(grid_m, grid_n, w8a8.get("SPLIT_K", 1))](
        a, weight, out, None, None, None, None,
        rows, out_features, in_features, a.stride(0), 0, weight.stride(0), out.stride(0),
        scale_rows, 0, scale_rows.stride(0),
        A_ROW_DIV=1, GATED=False, ROUTED_WEIGHT=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, UPCAST=INTERPRET, FP8_W=True, DENSE=True, num_warps=warps, num_stages=stages,
        **w8a8,
    )  # fmt: skip
    return out
