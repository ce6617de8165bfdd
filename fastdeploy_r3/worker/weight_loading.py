"""The worker's side of every control command (weight updates, memory release/resume, checksums),
with one rule at the boundary: whatever fails is a typed result, never an exception that ends the
worker. A SafetensorError, a JSONDecodeError, a KeyError of a malformed payload or a gloo timeout
become `WeightUpdateResult(error=...)` in words that name what failed, never a path, a traceback or
file content (the worker's log has the details under the same words).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastdeploy_r3.worker.messages import (
    ChecksumWeights,
    DestroyWeightUpdateGroup,
    ExpertDistribution,
    ExpertDistributionResult,
    ExpertRebalanceResult,
    InitWeightUpdateGroup,
    MemoryResult,
    RebalanceExperts,
    ReleaseMemory,
    ResumeMemory,
    UpdateWeights,
    WeightsChecksum,
    WeightUpdateResult,
)

if TYPE_CHECKING:
    from fastdeploy_r3.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ControlMessage = (
    InitWeightUpdateGroup | DestroyWeightUpdateGroup | UpdateWeights | ReleaseMemory | ResumeMemory | ChecksumWeights
    | ExpertDistribution | RebalanceExperts
)
ControlResult = WeightUpdateResult | MemoryResult | WeightsChecksum | ExpertDistributionResult | ExpertRebalanceResult


def run_control(runner: ModelRunner, msg: ControlMessage) -> ControlResult:
    rank = runner.rank
    if isinstance(msg, ExpertDistribution):
        return expert_distribution(runner, msg)
    if isinstance(msg, RebalanceExperts):
        return rebalance_experts(runner, msg)
    if isinstance(msg, (ReleaseMemory, ResumeMemory)):
        try:
            assert runner.memory is not None
            memory = runner.memory
            before = _allocated(runner)
            nbytes = memory.release(msg.tags) if isinstance(msg, ReleaseMemory) else memory.resume(msg.tags)
            return MemoryResult(rank, nbytes=nbytes, allocated_before=before, allocated_after=_allocated(runner))
        except Exception as e:  # noqa: BLE001 - out of memory on resume, most likely: the engine reports it
            logger.exception("%s on rank %d failed", type(msg).__name__, rank)
            return MemoryResult(rank, error=f"{type(msg).__name__} failed on rank {rank} ({type(e).__name__}: "
                                            f"{_short(e)})")
    if isinstance(msg, ChecksumWeights):
        from fastdeploy_r3.worker.memory_occupation import weights_checksums

        try:
            assert runner.model is not None
            return WeightsChecksum(rank, weights_checksums(runner.model))
        except Exception as e:  # noqa: BLE001
            logger.exception("checksum on rank %d failed", rank)
            return WeightsChecksum(rank, error=f"checksum failed on rank {rank} ({type(e).__name__})")
    return _weight_command(runner, msg)


def _weight_command(
    runner: ModelRunner, msg: InitWeightUpdateGroup | DestroyWeightUpdateGroup | UpdateWeights
) -> WeightUpdateResult:
    from fastdeploy_r3.worker.tensor_transport import TensorTransportError, deserialize_named_tensors
    from fastdeploy_r3.worker.weight_updater import WeightUpdateError

    updater = runner.weight_updater
    assert updater is not None
    rank = runner.rank
    try:
        if isinstance(msg, InitWeightUpdateGroup):
            updater.init_group(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                               msg.group_name, msg.backend)
            return WeightUpdateResult(rank)
        if isinstance(msg, DestroyWeightUpdateGroup):
            updater.destroy_group(msg.group_name)
            return WeightUpdateResult(rank)
        if runner.memory is not None and runner.memory.param_specs is not None:
            raise WeightUpdateError("the weights are released; call /resume_memory_occupation with the "
                                    "'weights' tag before updating them")
        if msg.model_path is not None:
            n = updater.from_disk(msg.model_path)
        elif msg.group_name is not None:
            n = updater.from_distributed(msg.names, msg.dtypes, msg.shapes, msg.group_name)
        elif msg.serialized_named_tensors is not None:
            payloads = msg.serialized_named_tensors
            if len(payloads) != runner.world_size:
                raise WeightUpdateError(f"serialized_named_tensors has {len(payloads)} entries; send one per TP "
                                        f"rank ({runner.world_size})")
            try:
                tensors = deserialize_named_tensors(payloads[rank], msg.load_format, rank, runner.device)
            except TensorTransportError as e:
                raise WeightUpdateError(f"weight update refused, no weight changed: {e}") from e
            n = updater.from_tensors(tensors)
            if runner.device.type == "cuda":
                import torch

                # the copies out of the trainer's memory are queued on our stream: finish them before the
                # answer lets the trainer free or reuse that memory
                torch.cuda.synchronize(runner.device)
        else:
            n = updater.from_tensors(list(msg.tensors or []))  # type: ignore[arg-type]
        return WeightUpdateResult(rank, num_tensors=n)
    except WeightUpdateError as e:
        return WeightUpdateResult(rank, error=str(e), weights_changed=e.weights_changed)
    except Exception as e:  # noqa: BLE001 - e.g. a SafetensorError from a file that changed under us
        logger.exception("%s on rank %d failed", type(msg).__name__, rank)
        # nothing of an unexpected failure is trusted: the engine treats the weights as possibly changed
        changed = isinstance(msg, UpdateWeights)
        return WeightUpdateResult(rank, error=f"{type(msg).__name__} failed on rank {rank} ({type(e).__name__}); the "
                                              "engine log has the details", weights_changed=changed)


def _allocated(runner: ModelRunner) -> int:
    if runner.device.type != "cuda":
        return 0
    import torch

    torch.cuda.synchronize(runner.device)
    return torch.cuda.memory_allocated(runner.device)


def _short(e: BaseException) -> str:
    """The first line of an error we raise ourselves or torch's OOM text, bounded; paths never appear there."""
    return str(e).splitlines()[0][:200] if str(e) else "no message"


def expert_distribution(runner: ModelRunner, msg: ExpertDistribution) -> ExpertDistributionResult:
    """Start, stop or dump this rank's expert load record (model_executor/layers/expert_load.py)."""
    recorder = getattr(runner.model, "expert_load", None)
    if recorder is None:
        return ExpertDistributionResult(runner.rank, error=f"rank {runner.rank} has no model loaded")
    if msg.action in ("start", "stop"):
        was = recorder.recording
        if msg.action == "start":
            recorder.start()
        else:
            recorder.stop()
        if runner.decode_graphs is not None and recorder.recording != was:
            runner.capture_decode_graphs()  # graphs bake in whether their MoE layers count (expert_load.py)
    elif msg.action == "dump":
        return ExpertDistributionResult(runner.rank, counts=recorder.dump(), recording=recorder.recording)
    else:
        return ExpertDistributionResult(runner.rank, error=f"unknown expert distribution action {msg.action!r}; "
                                                           "use start, stop or dump")
    return ExpertDistributionResult(runner.rank, recording=recorder.recording)


def rebalance_experts(runner: ModelRunner, msg: RebalanceExperts) -> ExpertRebalanceResult:
    """This rank's side of an EPLB move: broadcasts over the worker group, every rank in the same order."""
    import torch.distributed as dist

    from fastdeploy_r3.model_executor.layers.expert_rebalance import move_experts

    try:
        assert runner.model is not None
        nbytes = move_experts(runner.model, tuple(msg.physical_to_logical), lambda t, src: dist.broadcast(t, src))
        if runner.decode_graphs is not None:  # they baked in the old dispatch's replica tables
            runner.capture_decode_graphs()
        return ExpertRebalanceResult(runner.rank, bytes_received=nbytes)
    except Exception as e:  # noqa: BLE001 - the engine reports it and marks the weights broken
        logger.exception("expert rebalance on rank %d failed", runner.rank)
        return ExpertRebalanceResult(runner.rank, error=f"{type(e).__name__}: {_short(e)}")
