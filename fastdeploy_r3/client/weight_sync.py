"""Trainer side of the RL control plane: push new weights to a running server, SGLang-style.

    sync = WeightSync("http://127.0.0.1:8000")
    sync.init_group(master_port=29600)              # trainer = rank 0, the engine's TP ranks 1..N
    sync.push(model_state_items, weight_version="7")  # names/dtypes/shapes announced, then broadcast
    sync.destroy_group()

Each call posts the endpoint from a helper thread while this thread takes its part in the collective
(the server answers only once the collective is over), which is how slime drives SGLang. Tensors are
full checkpoint tensors under HF names; every engine rank keeps its own shard.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import time
from collections.abc import Iterable
from typing import Any

import httpx
import torch
import torch.distributed as dist

from fastdeploy_r3.distributed.weight_update_group import destroy_weight_update_group, init_weight_update_group


def http_client(timeout_s: float) -> httpx.Client:
    """A keep-alive client with Nagle off: a trainer's update is many small calls in a row, and with Nagle on
    each request body waited for the server's delayed ACK (~40 ms a call)."""
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return httpx.Client(timeout=timeout_s, transport=httpx.HTTPTransport(socket_options=nodelay))


class WeightSyncError(RuntimeError):
    """The server refused or failed a control call; the message carries its answer."""


class WeightSync:
    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.group: dist.ProcessGroup | None = None
        self.group_name: str | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fdr3-weight-sync")
        self._http = http_client(timeout_s)

    # -- plain control calls ------------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        resp = self._http.post(f"{self.base_url}{path}", json=body or {})
        data = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code != 200 or data.get("success") is False:
            raise WeightSyncError(f"{path} answered {resp.status_code}: {data.get('message') or resp.text}")
        return data

    def get(self, path: str) -> dict[str, Any]:
        resp = self._http.get(f"{self.base_url}{path}")
        if resp.status_code != 200:
            raise WeightSyncError(f"{path} answered {resp.status_code}: {resp.text}")
        return resp.json()

    def weight_version(self) -> str:
        return str(self.get("/get_weight_version")["weight_version"])

    def update_from_disk(self, model_path: str, weight_version: str | None = None, **kw: Any) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, **kw}
        return self.post("/update_weights_from_disk", body)

    # -- the weight update group ----------------------------------------------------------------------

    def init_group(
        self,
        master_port: int,
        master_address: str = "127.0.0.1",
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Create the group with this process as rank 0 and every TP rank of the server after it."""
        if self.group is not None:
            raise WeightSyncError(f"group {self.group_name!r} is open; destroy_group() first")
        tp_size = int(self.get("/get_server_info").get("tp_size", 1))
        world_size = 1 + tp_size
        body = {
            "master_address": master_address, "master_port": master_port, "rank_offset": 1,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }
        answer = self._pool.submit(self.post, "/init_weights_update_group", body)
        try:
            self.group = init_weight_update_group(master_address, master_port, 0, world_size, group_name, backend)
        finally:
            answer.result()  # raises the server's refusal, if any
        self.group_name = group_name

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Announce the tensors, broadcast each from rank 0, return the server's answer."""
        if self.group is None:
            raise WeightSyncError("no weight update group; call init_group() first")
        items = [(name, t.detach().contiguous()) for name, t in named_tensors]
        body = {
            "names": [n for n, _ in items],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "group_name": self.group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        answer = self._pool.submit(self.post, "/update_weights_from_distributed", body)
        for name, tensor in items:
            work = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
            # a server that refused the announcement never receives: do not wait on it forever
            while not work.is_completed():
                if answer.done() and answer.exception() is not None:
                    self._abandon_group()
                    raise WeightSyncError(f"the server stopped receiving before {name!r}: {answer.exception()}")
                time.sleep(0.001)
        return answer.result()

    def _abandon_group(self) -> None:
        """A collective left half done: the group cannot be trusted again; drop our side of it."""
        group, self.group, self.group_name = self.group, None, None
        if group is not None:
            with contextlib.suppress(Exception):
                destroy_weight_update_group(group)

    def destroy_group(self) -> None:
        if self.group is None:
            return
        self.post("/destroy_weights_update_group", {"group_name": self.group_name})
        destroy_weight_update_group(self.group)
        self.group, self.group_name = None, None

    def close(self) -> None:
        try:
            self.destroy_group()
        finally:
            self._pool.shutdown(wait=False)
            self._http.close()
