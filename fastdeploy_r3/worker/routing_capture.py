"""RoutingCapture: the forward context's routing sink, one per worker (docs/architecture.md, "The R3 data path").

Shape legend: T = tokens of the step (real ones; a CUDA graph may launch more), L = MoE layers,
K = experts per token.

One step, as the model runner drives it:

    capture.begin_step(T, positions)          # positions [T] needed in debug mode
    with set_forward_context(ForwardContext(..., routing_capture=capture)):
        model(...)                            # every MoE layer: capture.capture(moe_index, topk_ids [T', K]),
                                              # or the fused routing kernel writes capture_buffer() itself
    writer.write(writer.rows_of(capture, T), slot_mapping, tags, positions)   # rank 0 (worker/routing_writer.py)

The model layers reach it only through the forward context (model_executor/ never imports it).
The step buffer is int32 [max_num_batched_tokens, L, K] on the model's device whatever the routing
dtype: torch handles uint16 only in part, and the narrowing happens once, at copy-out (numpy astype
here, or scatter_rows_to_host on GPU, which reads device_rows()).
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy_r3.model_executor.ops.routing_capture_kernel import capture_topk_ids_dispatch
from fastdeploy_r3.r3.errors import RoutingReplayError, debug_rows


class RoutingCapture:
    def __init__(
        self,
        max_num_batched_tokens: int,
        num_moe_layers: int,
        top_k: int,
        num_experts: int,
        routing_dtype: np.dtype,
        device: torch.device | str = "cpu",
        debug_mode: bool = False,
    ) -> None:
        self.num_moe_layers = num_moe_layers
        self.top_k = top_k
        self.num_experts = num_experts
        self.routing_dtype = np.dtype(routing_dtype)
        self.debug_mode = debug_mode
        self.buffer = torch.zeros(max_num_batched_tokens, num_moe_layers, top_k, dtype=torch.int32, device=device)
        self._all_layers = (1 << num_moe_layers) - 1
        self._captured = 0  # bit i set once MoE layer i captured in this step
        self._num_tokens: int | None = None  # None outside a step
        self._positions: torch.Tensor | None = None

    @property
    def max_num_batched_tokens(self) -> int:
        return self.buffer.shape[0]

    def begin_step(self, num_tokens: int, positions: torch.Tensor | None = None) -> None:
        """Start a step of num_tokens real tokens; positions [num_tokens] are required in debug mode."""
        if not 0 <= num_tokens <= self.max_num_batched_tokens:
            raise RoutingReplayError(
                f"step of {num_tokens} tokens does not fit the routing capture buffer of "
                f"{self.max_num_batched_tokens} rows (max_num_batched_tokens)"
            )
        if self.debug_mode and (positions is None or positions.shape != (num_tokens,)):
            got = None if positions is None else tuple(positions.shape)
            raise RoutingReplayError(f"debug mode needs positions [{num_tokens}] at begin_step, got {got}")
        self._num_tokens = num_tokens
        self._positions = positions
        self._captured = 0

    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        """Record MoE layer moe_index's top-k ids [T', K] (T' >= T: a CUDA graph may pad). Host checks only."""
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.top_k:
            raise RoutingReplayError(
                f"MoE layer {moe_index} captured ids of shape {tuple(topk_ids.shape)}; expected [T, {self.top_k}]"
            )
        self._check_capture(moe_index, topk_ids.shape[0], topk_ids.device)
        capture_topk_ids_dispatch(self.buffer, moe_index, topk_ids)  # buffer[:T', moe_index] = topk_ids
        self._captured |= 1 << moe_index

    def capture_buffer(self, moe_index: int, num_tokens: int) -> torch.Tensor:
        """The fused routing kernel's way in (ops/fused_routing.py writes buffer[t, moe_index] = ids[t] for
        each real token t < num_tokens itself, in the launch that routes): the checks of capture(), the
        layer counted as captured, and the step buffer [max_num_batched_tokens, L, K] int32 returned."""
        self._check_capture(moe_index, num_tokens, self.buffer.device)
        self._captured |= 1 << moe_index
        return self.buffer

    def _check_capture(self, moe_index: int, num_tokens: int, device: torch.device) -> None:
        if self._num_tokens is None:
            raise RoutingReplayError("routing captured outside a step; call begin_step() before the forward")
        if not 0 <= moe_index < self.num_moe_layers:
            raise RoutingReplayError(
                f"MoE layer index {moe_index} is outside [0, {self.num_moe_layers}); the model's MoE layers "
                "do not match moe_layer_ids of the routing replay config"
            )
        if self._captured >> moe_index & 1:
            raise RoutingReplayError(f"MoE layer {moe_index} captured twice in one step; each layer captures once")
        if not self._num_tokens <= num_tokens <= self.max_num_batched_tokens:
            raise RoutingReplayError(
                f"MoE layer {moe_index} captured {num_tokens} tokens in a step of {self._num_tokens} "
                f"(capture buffer holds {self.max_num_batched_tokens})"
            )
        if device != self.buffer.device:
            raise RoutingReplayError(f"MoE layer {moe_index} captured ids on {device}, "
                                     f"the capture buffer is on {self.buffer.device}")

    def mark_graph_replay(self) -> None:
        """A replayed CUDA graph runs the kernels it recorded without calling capture(): count them done.

        Call only for a graph whose recording passed check_complete().
        """
        self._captured = self._all_layers

    def check_complete(self) -> None:
        """Raise unless every MoE layer captured exactly once since begin_step()."""
        if self._num_tokens is None:
            raise RoutingReplayError("no step in progress; call begin_step() before the forward")
        missing = [i for i in range(self.num_moe_layers) if not self._captured >> i & 1]
        if missing:
            raise RoutingReplayError(
                f"MoE layer(s) {missing} did not capture routing in this step; every MoE layer must call "
                "get_forward_context().routing_capture.capture() right after its top-k"
            )

    def device_rows(self, num_tokens: int) -> torch.Tensor:
        """View [T, L, K] int32 of the step buffer, for scatter_rows_to_host on GPU (no copy, ids unchecked)."""
        self._check_step(num_tokens)
        return self.buffer[:num_tokens]

    def step_rows(self, num_tokens: int) -> np.ndarray:
        """The step's rows [T, L, K] in the routing dtype, real tokens only; debug rows in debug mode."""
        self._check_step(num_tokens)
        ids = self.buffer[:num_tokens].cpu().numpy()  # [T, L, K] int32; the one sync of the CPU path
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            t, layer, _ = (int(x) for x in np.argwhere((ids < 0) | (ids >= self.num_experts))[0])
            raise RoutingReplayError(
                f"token {t} of the step got expert ids {ids[t, layer].tolist()} in MoE layer {layer}; "
                f"ids must be in [0, {self.num_experts})"
            )
        if self.debug_mode:
            assert self._positions is not None  # begin_step enforces it
            positions = self._positions.cpu().numpy()  # [T]
            return debug_rows(positions, self.num_moe_layers, self.top_k, self.routing_dtype)
        return ids.astype(self.routing_dtype)

    def _check_step(self, num_tokens: int) -> None:
        self.check_complete()
        if num_tokens != self._num_tokens:
            raise RoutingReplayError(f"asked for {num_tokens} rows of a step of {self._num_tokens} tokens")
