"""The engine's counters and gauges by /metrics name (fastdeploy_r3_engine_<name>[_total], served by
entrypoints/openai/metrics.py through the engine process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdeploy_r3.engine.engine_service import EngineService


def engine_metrics(svc: EngineService) -> dict[str, float]:
    c, res, r3, ov = svc.kv.counters, svc.parts.resources, svc.token_processor.r3, svc.overlap_counters
    return {
        "num_gpu_blocks": svc.num_gpu_blocks,
        "num_cpu_blocks": svc.num_cpu_blocks,
        "num_free_gpu_blocks": svc.kv.gpu.num_free_blocks,
        "num_running": len(svc.scheduler.running),
        "num_waiting": len(svc.scheduler.waiting),
        "num_loading": len(svc.scheduler.loading),
        "prefix_hit_blocks": c.gpu_hit_blocks,
        "swap_out_blocks": c.swap_out_blocks,
        "swap_in_blocks": c.swap_in_blocks,
        "storage_load_blocks": c.storage_load_blocks,
        "storage_load_failed_blocks": c.storage_load_failed_blocks,
        "storage_put_blocks": c.storage_put_blocks,
        "cache_transfer_replacements": 0 if res.transfers is None else res.transfers.replacements,
        "kv_storage_lookup_failures": 0 if res.lookup is None else res.lookup.health.counters.failures,
        **(res.transfers.store_counters if res.transfers is not None else {}),
        "evicted_blocks": c.evicted_blocks,
        "preemptions": svc.scheduler.num_preemptions,
        "weight_updates": svc.control.num_weight_updates,
        "overlapped_steps": ov.overlapped_steps,
        "sync_steps": ov.sync_steps,
        "early_sent_steps": ov.early_sent_steps,
        "discarded_chunks": ov.discarded_chunks,
        "discarded_steps": ov.discarded_steps,
        "launched_ahead_steps": ov.launched_ahead_steps,
        "r3_rows_delivered": r3.rows_delivered,
        "r3_bytes": r3.bytes_delivered,
        "r3_failures": r3.failures,
        "r3_gather_seconds": r3.gather_seconds,
        **svc.step_counters.as_metrics(),
        **_spec_metrics(svc),
    }


def _spec_metrics(svc: EngineService) -> dict[str, float]:
    """Speculative decoding (engine/speculative.py): absent when it is off."""
    if svc.speculation is None:
        return {}
    c = svc.speculation.counters
    return {"spec_verify_steps": c.verify_steps, "spec_draft_tokens": c.draft_tokens,
            "spec_accepted_tokens": c.accepted_tokens}
