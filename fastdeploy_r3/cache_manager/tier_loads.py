"""Admissions whose loads from the KV connectors have not all finished: the prefix cache manager's
LOADING requests, and the loads of requests freed while their bytes were still moving.

    admit(wait=False) ─► blocks allocated and held, each tier's load started in order ─┐
          │ every finish_load answered at once (GPU hits, the CPU tier, a fast ack)    │ a finish_load said
          ▼                                                                            ▼ None (storage)
     num_computed_tokens                                  LOADING: advance() asks again each step;
                                                          when the last tier answered, finished()
    free() while LOADING ─► abandoned: the request is gone, its blocks stay held here until the load
                            answers (the CTM must not write into a block another request was given),
                            then they go back to the pool, uncached

A tier's load is started only when the tier before it finished, with the blocks after its hit: a
failed block truncates the hit there and later tiers load nothing (start_load with no blocks, which
releases what hold() kept). Loaded blocks are cached in the GPU pool as their tier answers, unless
the admission lost the right to (a flush or a new weight root while it loaded, or it was abandoned):
then they serve the request alone. Their routing tags are the ones their connector answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastdeploy_r3.cache_manager.block_pool import BlockPool, KVBlock
from fastdeploy_r3.cache_manager.kv_connector import TierHit


@dataclass
class PendingAdmission:
    """One request's block table while its tier hits load."""

    request_id: str
    blocks: list[KVBlock]  # the whole table: GPU hits, then the blocks loads write, then new ones
    tiers: list[TierHit]
    usable: int  # leading full blocks in place so far: GPU hits, then every block of finished loads
    partial_tokens: int = 0  # after them, the prompt's partial last block a prefill server sent (PD) is in place
    tier: int = 0  # the tier whose load runs now (or starts next)
    started: bool = False
    loaded_ok: bool = True  # every block of every finished load arrived: later tiers may load
    dst: list[KVBlock] = field(default_factory=list)  # the blocks the running load writes
    cache: bool = True  # loaded blocks may enter the GPU prefix cache
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return self.tier == len(self.tiers)


def advance(adm: PendingAdmission, gpu: BlockPool, new_tag: Callable[[], int], block: bool) -> bool:
    """Start or finish the admission's loads in tier order until one is still running (False) or all
    answered (True). `new_tag()` gives each destination block the fresh tag its rows get when the tier
    has none of this engine (storage)."""
    while not adm.done:
        tier_hit = adm.tiers[adm.tier]
        n = len(tier_hit.keys)  # a partial block (BlockKey.partial) last
        if not adm.started:
            start = adm.usable
            adm.dst = adm.blocks[start : start + n] if adm.loaded_ok and not adm.abandoned else []
            tags = [new_tag() for _ in adm.dst]
            tier_hit.connector.start_load(tier_hit, [b.block_id for b in adm.dst], tags)
            adm.started = True
        result = tier_hit.connector.finish_load(tier_hit, block=block)
        if result is None:
            return False
        for b, tag in zip(adm.dst, result.tags):
            b.routing_tag = tag
        for b, key in zip(adm.dst[: result.num_loaded], tier_hit.keys):
            if adm.cache and not key.partial:
                gpu.cache(b, key.block_hash, key.token_ids)
        adm.usable += min(result.num_loaded, tier_hit.num_full)
        if tier_hit.partial_tokens and result.num_loaded == n:
            adm.partial_tokens = tier_hit.partial_tokens
        adm.loaded_ok = adm.loaded_ok and result.num_loaded == n
        adm.tier, adm.started, adm.dst = adm.tier + 1, False, []
    return True


def hashes_in_flight(adm: PendingAdmission) -> set[bytes]:
    """Hashes of the blocks the admission's running load writes and will cache once it answered: a
    request after the same prefix hits them in the GPU pool then, instead of loading a second copy."""
    if not adm.started or not adm.cache:
        return set()
    return {key.block_hash for key in adm.tiers[adm.tier].keys[: len(adm.dst)] if not key.partial}


def check_loading(adm: PendingAdmission) -> None:
    """Raise AssertionError if a load in flight could be read: its blocks hold, uncached, tag-less."""
    assert adm.usable + (1 if adm.partial_tokens else 0) <= len(adm.blocks), adm
    for b in adm.dst:
        assert b.ref_cnt > 0, f"{b} is written by the load of {adm.request_id} but nobody holds it"
        assert b.block_hash is None, f"{b} is cached while the load of {adm.request_id} writes it"
        assert b.routing_tag == 0, f"{b} has a tag while the load of {adm.request_id} writes it"
