"""R3 delivery of one finished request, for the API server, offline `LLM` and nothing else (DESIGN.md §7).

    response mode   payload per choice = base64(.npy [rows, L, K]) (or the arrays as they are, offline)
    local/p2pstore  store.put(rollout_id, [choice arrays]) before the request is answered

in the request's routing_layout (else the server's): `moe` [rows, L, K] as gathered, or `all_layers`
[rows, num_hidden_layers, K] with dense layers holding the sentinel (r3/layouts.py), in responses and
stores alike.

One policy, fail closed: a choice that asked for R3 and has none, an array of the wrong shape or
dtype, a no-route hole, or a put that did not complete fails the request (R3DeliveryError); nothing
is half delivered as if it were whole. `deliver` blocks (encoding, disk, network): the server runs it
in a worker thread. The rollout id comes from r3/rollout_id.py's one rule.

A put waits at most `store_timeout_s`; one that fails or misses it marks the store degraded
(blobstore/health.py), and while it is, puts fail at once with the reason (one probe every few seconds
finds it back), so a dead store costs each request a clear error, not a wait. `store_problem()` is
what /health and /ready report.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from fastdeploy_r3.blobstore.health import DeadlineCaller, StoreHealth, StoreUnavailableError
from fastdeploy_r3.r3.codec import encode_routed_experts
from fastdeploy_r3.r3.config import RoutingReplayConfig
from fastdeploy_r3.r3.layouts import R3PayloadError, check_moe_rows, row_range, to_all_layers
from fastdeploy_r3.r3.stores import RoutingStore, RoutingStoreError

_PROBE_EVERY_S = 1.0

if TYPE_CHECKING:
    from fastdeploy_r3.outputs import RequestOutput


class R3DeliveryError(RuntimeError):
    """The request's R3 cannot be delivered whole; the request must fail."""


class R3StoreFailedError(R3DeliveryError):
    """The store did not take the request's R3 (see the chained RoutingStoreError)."""


@dataclass
class R3Result:
    """Per choice, in index order: base64 payload (response mode, inline), start row, and the array in
    the delivered layout (what offline outputs carry)."""

    payloads: list[str | None]
    starts: list[int | None]
    layout: str | None = None  # None: nothing delivered
    arrays: list[np.ndarray] | None = None

    @classmethod
    def nothing(cls, n: int) -> R3Result:
        return cls([None] * n, [None] * n)

    @property
    def payload_bytes(self) -> int:
        return sum(len(p) for p in self.payloads if p is not None)


class R3Delivery:
    def __init__(self, config: RoutingReplayConfig, store: RoutingStore | None) -> None:
        self.config = config
        self.store = store  # None: R3 goes in the response
        self.health = StoreHealth("r3 store")
        self._caller = DeadlineCaller(self.health, float(config.store_timeout_s)) if store is not None else None
        self._last_probe = float("-inf")

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(self.config.moe_layer_ids or [])

    def wants(self, return_routed_experts: bool | None) -> bool:
        """R3 is delivered unless the server has it off or the request opted out."""
        return self.config.enable_routing_replay and return_routed_experts is not False

    def checked_arrays(self, final: RequestOutput) -> list[np.ndarray]:
        """Every choice's [rows, L, K], in index order, each checked; else R3DeliveryError."""
        rr = self.config
        arrays = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            what = f"routed_experts of choice {c.index} of {final.request_id}"
            if c.routed_experts is None:
                # a trainer asked for R3 and would replay nothing
                raise R3DeliveryError(f"the engine returned no {what}")
            start, end = row_range(len(final.prompt_token_ids), len(c.token_ids), c.routed_experts_start)
            try:
                check_moe_rows(c.routed_experts, self.moe_layer_ids, end - start, rr.moe_top_k, rr.routing_dtype,
                               row_offset=start, what=what)
            except R3PayloadError as e:
                raise R3DeliveryError(str(e)) from e
            arrays.append(c.routed_experts)
        return arrays

    @staticmethod
    def meta(final: RequestOutput, layout: str, layer_ids: list[int]) -> dict[str, Any]:
        """What a store keeps beside the arrays: the weights that produced them and how they are laid out."""
        outputs = sorted(final.outputs, key=lambda c: c.index)
        spans = [[dataclasses.asdict(s) for s in c.weight_versions] for c in outputs]
        return {
            "weight_version": spans[0][-1]["version"] if spans and spans[0] else None,
            "weight_versions": spans,  # per choice: SGLang's spans of output tokens per version
            "spans_weight_versions": any(c.spans_weight_versions for c in outputs),
            "routing_layout": layout,
            "layer_ids": layer_ids,
        }

    def layout_of(self, routing_layout: str | None) -> str:
        return routing_layout or self.config.routing_layout

    def laid_out(self, moe_rows: list[np.ndarray], layout: str) -> tuple[list[np.ndarray], list[int]]:
        """The arrays in `layout` and the model layer id of each of their layers."""
        if layout == "all_layers":
            num_layers = self.config.num_hidden_layers
            return [to_all_layers(a, self.moe_layer_ids, num_layers) for a in moe_rows], list(range(num_layers))
        return moe_rows, self.moe_layer_ids

    def deliver(
        self, final: RequestOutput, rollout_id: str, inline: bool = True, routing_layout: str | None = None
    ) -> R3Result:
        """Check, lay out, then encode (response mode; inline=False leaves the arrays as they are) or store.

        Blocking. Raises R3DeliveryError (R3StoreFailedError for a failed put).
        """
        layout = self.layout_of(routing_layout)
        arrays, layer_ids = self.laid_out(self.checked_arrays(final), layout)
        starts: list[int | None] = [c.routed_experts_start for c in sorted(final.outputs, key=lambda c: c.index)]
        if self.store is None:
            payloads: list[str | None] = [encode_routed_experts(a) if inline else None for a in arrays]
            return R3Result(payloads, starts, layout, arrays)
        assert self._caller is not None
        try:
            # a put that lands after its deadline is taken back: the request was answered as failed
            undo = partial(self.store.delete, rollout_id, layer_ids)
            self._caller.call(self.store.put, rollout_id, arrays, layer_ids, self.meta(final, layout, layer_ids),
                              undo=undo)
        except (RoutingStoreError, StoreUnavailableError, OSError) as e:
            raise R3StoreFailedError(f"storing routed_experts of rollout {rollout_id!r} failed: the R3 store "
                                     f"did not take it ({e})") from e
        return R3Result([None] * len(arrays), starts, layout, arrays)

    def store_problem(self) -> str | None:
        """Why R3 cannot be stored now (None: it can, or R3 goes in responses). Probes the store at most
        once a second, so a store that went down before any request noticed is reported too."""
        if self._caller is None or self.store is None:
            return None
        now = time.monotonic()
        if now - self._last_probe >= _PROBE_EVERY_S:
            self._last_probe = now
            try:
                self._caller.call(self.store.ping)
            except (RoutingStoreError, StoreUnavailableError, OSError):
                pass  # the health records it
        return self.health.degraded

    def close(self) -> None:
        if self._caller is not None:
            self._caller.close()
