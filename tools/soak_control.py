"""The soak's control-plane faults: calls an RL trainer can get wrong, which must each end in a clear
error with the server still serving (the old weights, nothing killed).

    bad-checkpoint      /update_weights_from_disk of a directory whose safetensors file is cut short
    stalled-rendezvous  /init_weights_update_group to a port nobody listens on
    dead-trainer        a trainer process (tools/soak_trainer.py) joins a weight update group, the
                        update's broadcast starts, and the trainer is SIGKILLed after a few tensors:
                        the update must be refused with a clear error; then a new trainer must be
                        able to join a group of the same name and push a complete update (the
                        checkpoint's own tensors, so the weights end as they were), after which the
                        server serves again

Each ends in one Outcome: CLEAR when the call was refused with a JSON error and /health answers
right after; UNCLEAR when the answer was anything else or the server did not serve afterwards; HUNG
when no answer came within the deadline.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid

import httpx
from soak_load import CLEAR, HUNG, UNCLEAR, Outcome

CALL_DEADLINE_S = 120.0
TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak_trainer.py")
DEAD_AFTER = 3  # tensors the dying trainer broadcasts before its SIGKILL (the tiny model has dozens)


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
    if name == "dead-trainer":
        return dead_trainer(server_url, model_dir)
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


# -- dead trainer mid-broadcast ---------------------------------------------------------------------


class ControlFailed(Exception):
    """One step of the dead-trainer story went wrong: (outcome, detail)."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


class Trainer:
    """tools/soak_trainer.py as a child process, its JSON lines read by a thread."""

    def __init__(self, model_dir: str, port: int, group: str, tensors: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen([sys.executable, TRAINER, "--model", model_dir, "--port", str(port),
                                      "--group", group, "--tensors", str(tensors), "--timeout", "60"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, key: str, timeout: float = CALL_DEADLINE_S) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise ControlFailed(HUNG, f"the trainer printed no {key!r} within {timeout:g} s") from None
        if line is None or key not in line:
            raise ControlFailed(UNCLEAR, f"the trainer exited ({self.proc.poll()}) before {key!r}")
        return line

    def finish(self) -> None:
        """Let it leave (it destroys its group), or kill it if it does not."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("done\n")
                self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def _call(server_url: str, path: str, body: dict) -> httpx.Response:
    try:
        return httpx.post(f"{server_url}{path}", json=body, timeout=CALL_DEADLINE_S)
    except httpx.TimeoutException:
        raise ControlFailed(HUNG, f"{path}: no answer within {CALL_DEADLINE_S:g} s") from None
    except httpx.HTTPError as e:
        raise ControlFailed(UNCLEAR, f"{path}: the connection failed ({type(e).__name__}): the server died?") from e


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return ""
    return body.get("message") or (body.get("error") or {}).get("message") or ""


def _in_thread(fn, *args: object) -> tuple[threading.Thread, list]:  # noqa: ANN001 - any call
    box: list = []

    def run() -> None:
        try:
            box.append(fn(*args))
        except ControlFailed as e:
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _join(t: threading.Thread, box: list) -> httpx.Response:
    t.join(CALL_DEADLINE_S + 10)
    if not box:
        raise ControlFailed(HUNG, "a control call did not return")
    if isinstance(box[0], ControlFailed):
        raise box[0]
    return box[0]


def _push(server_url: str, model_dir: str, group: str, tensors: int, version: str) -> tuple[Trainer, httpx.Response]:
    """A trainer joins `group` and broadcasts `tensors` of the checkpoint; the update call's answer
    comes back once the server has them all (tensors < 0) — or, for a trainer killed by the caller,
    once the server gave up on it: the caller joins the returned thread's answer."""
    port = _closed_port()
    trainer = Trainer(model_dir, port, group, tensors)
    try:
        announced = trainer.expect("names")
        r = _call(server_url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group, "backend": "gloo"})
        if r.status_code != 200:
            raise ControlFailed(UNCLEAR, f"/init_weights_update_group with a live trainer: {r.status_code} "
                                         f"{r.text[:200]}")
        trainer.expect("joined")
        t, box = _in_thread(_call, server_url, "/update_weights_from_distributed",
                            {**announced, "group_name": group, "weight_version": version})
        trainer.expect("sent")
        if tensors >= 0:
            trainer.kill()  # mid-broadcast: the server waits for tensors that never come
        return trainer, _join(t, box)
    except BaseException:
        trainer.kill()
        raise


def dead_trainer(server_url: str, model_dir: str) -> Outcome:
    name, group = "dead-trainer", f"soak-{uuid.uuid4().hex[:8]}"
    try:
        _, dead = _push(server_url, model_dir, group, DEAD_AFTER, f"dead-{group}")
        if dead.status_code < 400 or not _message(dead):
            return Outcome(name, UNCLEAR, f"an update whose trainer died answered {dead.status_code} {dead.text[:200]}")
        # the same group name again: the broken group was torn down; a complete push heals the server
        trainer, healed = _push(server_url, model_dir, group, -1, f"healed-{group}")
        trainer.finish()
        if healed.status_code != 200:
            return Outcome(name, UNCLEAR, f"a complete update after the dead trainer: {healed.status_code} "
                                          f"{healed.text[:200]}")
        r = _call(server_url, "/destroy_weights_update_group", {"group_name": group})
        if r.status_code != 200:
            return Outcome(name, UNCLEAR, f"/destroy_weights_update_group: {r.status_code} {r.text[:200]}")
        served = _call(server_url, "/v1/completions", {"prompt": [20, 21, 22], "max_tokens": 2, "temperature": 0})
    except ControlFailed as e:
        return Outcome(name, e.outcome, e.detail)
    if served.status_code != 200:
        return Outcome(name, UNCLEAR, f"after the healing update a request answered {served.status_code} "
                                      f"{served.text[:200]}")
    return Outcome(name, CLEAR, f"/update_weights_from_distributed: {dead.status_code} {_message(dead)}")
