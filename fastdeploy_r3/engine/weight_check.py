"""/weights_checker: a checksum of the loaded weights that a trainer (or a second engine) can compare.

Algorithm: SHA-256 of each parameter's raw bytes as this engine holds it (its own parameter names,
each TP rank its shard; dtype and layout as loaded), per rank; the engine checksum is the SHA-256 of
"rank|name|digest" lines over every rank, names sorted. Two engines with the same config and the same
weights give the same engine checksum; a trainer compares per-parameter digests with
`fastdeploy_r3.worker.memory_occupation.weights_checksums` run on the same model class.

Actions (SGLang's names): "checksum" answers the digests; "snapshot" remembers them; "compare"
answers which parameters differ from the snapshot (success only when none does).
"""

from __future__ import annotations

import hashlib

from fastdeploy_r3.engine.messages import WeightsReport

ACTIONS = ("checksum", "snapshot", "compare")


def engine_checksum(per_rank: list[dict[str, str]]) -> str:
    h = hashlib.sha256()
    for rank, digests in enumerate(per_rank):
        for name in sorted(digests):
            h.update(f"{rank}|{name}|{digests[name]}\n".encode())
    return h.hexdigest()


def compare(snapshot: list[dict[str, str]], now: list[dict[str, str]], skip: list[str]) -> list[str]:
    """Names ("rank r: name") whose digest differs from the snapshot, skipped names left out."""
    out = []
    for rank, (before, after) in enumerate(zip(snapshot, now)):
        for name in sorted(set(before) | set(after)):
            if name not in skip and before.get(name) != after.get(name):
                out.append(f"rank {rank}: {name}")
    return out


def report(per_rank: list[dict[str, str]], mismatched: list[str] | None = None) -> WeightsReport:
    return WeightsReport(per_rank, engine_checksum(per_rank), list(mismatched or []))
