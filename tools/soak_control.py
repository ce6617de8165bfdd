"""The soak's control-plane faults: calls an RL trainer can get wrong, which must each end in a clear
error with the server still serving (the old weights, nothing killed).

    bad-checkpoint      /update_weights_from_disk of a directory whose safetensors file is cut short
    stalled-rendezvous  /init_weights_update_group to a port nobody listens on

Each ends in one Outcome: CLEAR when the call was refused with a JSON error and /health answers
right after; UNCLEAR when the answer was anything else or the server did not serve afterwards; HUNG
when no answer came within the deadline.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid

import httpx
from soak_load import CLEAR, HUNG, UNCLEAR, Outcome

CALL_DEADLINE_S = 120.0


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then released: nothing listens on it afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bad_checkpoint_dir(model_dir: str, work: str) -> str:
    """A copy of the model's config with its first safetensors file cut to 100 bytes."""
    out = os.path.join(work, f"bad-ckpt-{uuid.uuid4().hex[:8]}")
    os.makedirs(out)
    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        if name.endswith(".safetensors"):
            with open(src, "rb") as f, open(os.path.join(out, name), "wb") as g:
                g.write(f.read(100))
        elif os.path.isfile(src):
            shutil.copy(src, out)
    return out


def control_fault(name: str, server_url: str, model_dir: str, work: str) -> Outcome:
    if name == "bad-checkpoint":
        path, body = "/update_weights_from_disk", {"model_path": bad_checkpoint_dir(model_dir, work)}
    else:
        path, body = "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": _closed_port(),
                                                     "rank_offset": 1, "world_size": 2, "group_name": "soak-stall",
                                                     "backend": "gloo"}
    try:
        r = httpx.post(f"{server_url}{path}", json=body, timeout=CALL_DEADLINE_S)
    except httpx.TimeoutException:
        return Outcome(name, HUNG, f"{path}: no answer within {CALL_DEADLINE_S:g} s")
    except httpx.HTTPError as e:
        return Outcome(name, UNCLEAR, f"{path}: the connection failed ({type(e).__name__}): the server died?")
    try:
        message = r.json().get("message") or r.json().get("error", {}).get("message")
    except ValueError:
        message = None
    if r.status_code < 400 or not message:
        return Outcome(name, UNCLEAR, f"{path}: {r.status_code} {r.text[:200]}")
    try:
        alive = httpx.get(f"{server_url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        alive = False
    if not alive:
        return Outcome(name, UNCLEAR, f"{path} was refused ({message}) but the server stopped serving")
    return Outcome(name, CLEAR, f"{path}: {r.status_code} {message}")
