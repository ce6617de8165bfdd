"""GET /check_integrity on the engine side: the KV cache manager's books, checked on a live server.

Fault tests ask the surviving server after killing its peer (tests/pd/): the free list, ref counts,
hash map and block owners must agree, and with no request in flight no block may be referenced (one
still referenced then was reserved and never freed). Saves in flight pin their blocks until stored, and
a request freed while its storage load ran holds its blocks until the load answered (the CTM may still
write them), so an idle engine lets both finish first (bounded by the store's call deadline and the
transfer timeout, past which the CTM is killed). The books' own check covers LOADING requests: their
blocks are owned, and the blocks a load writes are uncached and carry no tag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy_r3.engine.messages import ControlReply, EngineState, IntegrityReport

if TYPE_CHECKING:
    from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager


def integrity_reply(kv: PrefixCacheManager, query_id: int, state: EngineState, num_requests: int) -> ControlReply:
    if num_requests == 0:
        kv.poll_transfers(block=True)
    report = IntegrityReport(num_requests, kv.gpu.num_blocks - kv.gpu.num_free_blocks, kv.gpu.num_blocks)
    try:
        kv.check_integrity()
    except AssertionError as e:
        return ControlReply(query_id, False, f"KV cache books disagree: {e}", state, report=report)
    if num_requests == 0 and report.num_referenced_blocks:
        return ControlReply(query_id, False, f"no request in flight but {report.num_referenced_blocks} blocks still "
                            "referenced: reserved and never freed", state, report=report)
    return ControlReply(query_id, True, "ok", state, report=report)
