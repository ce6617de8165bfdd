"""The unparseable and hostile checkpoints an RL user can hand /update_weights_from_disk, built from a
good fake checkpoint: each is a directory holding the good config.json and one defect."""

from __future__ import annotations

import json
import os
import shutil
import struct

import torch
from safetensors.torch import load_file, save_file

SECRET = "hunter2-SECRET-PASSWORD"


def _copy_config(good: str, out: str) -> None:
    os.makedirs(out)
    for name in os.listdir(good):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(good, name), os.path.join(out, name))


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _index(out: str, weight_map: object) -> None:
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map} if not isinstance(weight_map, list) else weight_map, f)


def broken_checkpoints(good: str, root: str) -> dict[str, str]:
    """name -> checkpoint directory with that defect (the twelve of a hostile-input review, and two more)."""
    good_file = os.path.join(good, "model.safetensors")
    with open(good_file, "rb") as f:
        good_bytes = f.read()
    header_len = struct.unpack("<Q", good_bytes[:8])[0]
    names = list(load_file(good_file))
    out: dict[str, str] = {}

    def new(name: str) -> str:
        path = os.path.join(root, name)
        _copy_config(good, path)
        out[name] = path
        return path

    _write(os.path.join(new("not_safetensors"), "model.safetensors"), b"this is a text file, not tensors\n" * 4)
    _write(os.path.join(new("truncated_data"), "model.safetensors"), good_bytes[: 8 + header_len + 100])
    _write(os.path.join(new("truncated_header"), "model.safetensors"), good_bytes[: 8 + header_len // 2])
    bad_json = b'{"lm_head.weight": {"dtype": "F32", "shape": [2, '
    _write(os.path.join(new("bad_header_json"), "model.safetensors"), struct.pack("<Q", len(bad_json)) + bad_json)
    secret = json.dumps({"lm_head.weight": SECRET}).encode()
    _write(os.path.join(new("secret_in_header"), "model.safetensors"), struct.pack("<Q", len(secret)) + secret)
    d = new("bad_index_json")
    shutil.copy(good_file, d)
    _write(os.path.join(d, "model.safetensors.index.json"), b"{not json")
    d = new("list_index")
    shutil.copy(good_file, d)
    _index(d, [1, 2, 3])
    d = new("traversal_index")
    shutil.copy(good_file, d)
    _index(d, {n: "../../../../../../etc/passwd" for n in names})
    d = new("absolute_index")
    shutil.copy(good_file, d)
    _index(d, {n: "/etc/hostname" for n in names})
    os.symlink("/dev/zero", os.path.join(new("dev_zero_symlink"), "model.safetensors"))
    os.mkfifo(os.path.join(new("fifo"), "model.safetensors"))
    d = new("symlink_out")
    outside = os.path.join(root, "outside.safetensors")
    shutil.copy(good_file, outside)
    os.symlink(outside, os.path.join(d, "model.safetensors"))
    tensors = load_file(good_file)
    save_file({k: (v * 100).to(torch.int8) for k, v in tensors.items()}, os.path.join(new("int8"), "model.safetensors"))
    save_file({k: v > 0 for k, v in tensors.items()}, os.path.join(new("bool"), "model.safetensors"))
    nan = dict(tensors)
    first = sorted(nan)[0]
    nan[first] = torch.full_like(nan[first], float("nan"))
    save_file(nan, os.path.join(new("nan"), "model.safetensors"))
    lossy = {k: v.to(torch.float64) + 1e-12 for k, v in tensors.items()}  # float64 values float32 cannot hold
    save_file(lossy, os.path.join(new("lossy_float64"), "model.safetensors"))
    return out
