"""Which rollout ids this server's requests hold, and their reservations in the shared store.

    claim(id)    409 material: another request here holds it (RolloutReservedError, no store I/O),
                 or the store says it is reserved elsewhere / stored (r3/reservation.py)
    get(id)      what delivery writes under: the request's overwrite flag and reservation
    release      when the request's generator closes, after its R3 was delivered

A claim is taken on the event loop with no await between the check and the insert, so two requests
of this server never both pass; the store's reservation settles it between servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from fastdeploy_r3.r3.delivery import R3Delivery
from fastdeploy_r3.r3.reservation import RESERVATION_MARGIN_S, Reservation, RolloutReservedError


@dataclass
class RolloutClaim:
    """A request's hold on its rollout id until it is answered."""

    overwrite: bool
    reservation: Reservation | None = None


class RolloutClaims:
    def __init__(self, delivery: R3Delivery) -> None:
        self.delivery = delivery
        self._held: dict[str, RolloutClaim] = {}

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._held

    def get(self, rollout_id: str) -> RolloutClaim | None:
        return self._held.get(rollout_id)

    async def claim(self, rollout_id: str, overwrite: bool, timeout_s: float) -> Callable[[], None]:
        """Hold the id for a request answered within `timeout_s`; returns the release. Raises
        RolloutConflictError, or the store's RoutingStoreError / StoreUnavailableError."""
        if rollout_id in self._held:
            raise RolloutReservedError(f"rollout id {rollout_id!r} is in flight in another request; wait for its "
                                       "answer or use another id")
        claim = RolloutClaim(overwrite)
        self._held[rollout_id] = claim
        try:
            claim.reservation = await asyncio.to_thread(
                self.delivery.reserve, rollout_id, timeout_s + RESERVATION_MARGIN_S, overwrite)
        except BaseException:
            del self._held[rollout_id]
            raise

        def release() -> None:
            if self._held.get(rollout_id) is claim:
                del self._held[rollout_id]
            if claim.reservation is not None:  # store I/O: off the loop, nobody waits for it
                reservation, claim.reservation = claim.reservation, None
                try:
                    asyncio.get_running_loop().run_in_executor(None, self.delivery.unreserve, reservation)
                except RuntimeError:  # no loop any more (shutdown): the lock expires with its ttl
                    pass

        return release
