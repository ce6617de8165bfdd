"""What a weight load may read and accept, checked before any parameter changes.

A checkpoint directory arrives from a caller (`/update_weights_from_disk`), so nothing in it is
trusted: an index may name files anywhere (`../../etc/passwd`, `/etc/hostname`), a `.safetensors`
may be a symlink to `/dev/zero` or a FIFO that blocks any reader forever, a header may be garbage or
carry text its author wants echoed back, a tensor may be int8 or full of NaN. The rules:

    files    only names the index lists (else every *.safetensors), each a plain relative name that
             resolves, symlinks followed, to a REGULAR file inside the directory (checked with
             stat before open, so a FIFO or a device is never opened)
    headers  parsed by safetensors; any failure is "file N is not a readable safetensors file",
             never the parser's text (it can quote the header)
    dtypes   floating point only; a dtype other than the model's is converted only when every
             value survives the round trip (`lossless_cast`), else refused; float8_e4m3fn weights and
             their `*_scale_inv` scales (float32) are kept as they are: which layers may hold them is
             the model's to say (quantization/fp8_loading.py), before any of them is read
    values   finite (no NaN, no inf)

Errors are `CheckpointError`: they name the tensor or the file's name inside the directory, never
a server path, a traceback or file content.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator

import torch

from fastdeploy_r3.model_executor.models.base import WeightLoadingError

INDEX_NAME = "model.safetensors.index.json"
# an index of a 1T-parameter checkpoint is a few MB; more is not an index
_MAX_INDEX_BYTES = 64 * 2**20
# safetensors dtype names that hold floating point values
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# and the fp8 weights of a block-wise fp8 checkpoint
HEADER_DTYPES = {**FLOAT_DTYPES, "F8_E4M3": torch.float8_e4m3fn}
SCALE_SUFFIX = "_scale_inv"


class CheckpointError(WeightLoadingError):
    """A checkpoint cannot be loaded safely; the message says what to fix, without paths or content."""


def safe_checkpoint_files(model_dir: str) -> list[str]:
    """The absolute paths of the checkpoint's files, each checked to be a regular file inside model_dir."""
    root = os.path.realpath(model_dir)
    if not os.path.isdir(root):
        raise CheckpointError("model_path is not a directory on the engine's machine")
    index = os.path.join(root, INDEX_NAME)
    if os.path.lexists(index):
        names = _index_file_names(_regular_file_inside(root, INDEX_NAME))
    else:
        names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
        if not names:
            raise CheckpointError(
                "no *.safetensors in model_path; convert the checkpoint to safetensors (save_pretrained does)"
            )
    return [_regular_file_inside(root, name) for name in names]


def _index_file_names(index_path: str) -> list[str]:
    if os.path.getsize(index_path) > _MAX_INDEX_BYTES:
        raise CheckpointError(f"{INDEX_NAME} is larger than {_MAX_INDEX_BYTES >> 20} MiB; it is not an index")
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{INDEX_NAME} is not valid JSON; rewrite it (save_pretrained writes one)") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{INDEX_NAME} has no 'weight_map' object of tensor name -> file name")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{INDEX_NAME}'s weight_map must map tensor names (strings) to file names (strings)")
    return sorted(set(weight_map.values()))


def _regular_file_inside(root: str, name: str) -> str:
    """root/name if name is a plain relative name resolving to a regular file under root."""
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or not name or any(p in ("", ".", "..") for p in parts) or "\x00" in name:
        raise CheckpointError(
            "the checkpoint index names a file outside model_path (absolute, '..' or empty); list only files "
            "inside the checkpoint directory"
        )
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise CheckpointError("a checkpoint file is a symlink that leads outside model_path; copy the file in")
    shown = os.path.basename(name)
    try:
        st = os.stat(path)
    except OSError:
        raise CheckpointError(f"checkpoint file {shown!r} named by the index does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"checkpoint file {shown!r} is not a regular file (a FIFO, device or directory)")
    return path


def shown_name(path: str) -> str:
    """How an error names a checkpoint file: its name inside the directory, never the server path."""
    return os.path.basename(path)


def safetensors_header(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor, from the headers only; float dtypes only."""
    from safetensors import safe_open

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    sl = f.get_slice(name)
                    out[name] = (str(sl.get_dtype()), tuple(sl.get_shape()))
        except Exception:  # noqa: BLE001 - SafetensorError's text can quote the header
            raise CheckpointError(
                f"checkpoint file {shown_name(path)!r} is not a readable safetensors file (bad or truncated "
                "header or data)"
            ) from None
    for name, (dtype, _) in out.items():
        if dtype not in HEADER_DTYPES:
            raise CheckpointError(
                f"weight {name!r} is stored as {dtype}; only floating point weights ({', '.join(HEADER_DTYPES)}) "
                "are loaded (an integer checkpoint needs its own loader)"
            )
    return out


def iter_checked_safetensors(
    files: list[str], device: torch.device | str, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time onto `device`; a file that fails to read is a CheckpointError.

    keep(name) False: the tensor is not read at all (another expert-parallel rank's experts)."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except WeightLoadingError:
            raise
        except Exception:  # noqa: BLE001 - the reader's text can quote file content
            raise CheckpointError(
                f"checkpoint file {shown_name(path)!r} could not be read (truncated or corrupt data)"
            ) from None


def check_tensor(name: str, tensor: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in model_dtype after the dtype and finiteness rules; CheckpointError otherwise."""
    _check_dtype(name, tensor)
    values = tensor.float() if tensor.dtype == torch.float8_e4m3fn else tensor  # isfinite has no fp8 kernel
    if not bool(torch.isfinite(values).all()):
        raise CheckpointError(f"weight {name!r} holds NaN or inf values; the trainer's weights are broken")
    return lossless_cast(name, tensor, model_dtype)


def check_tensors(named: list[tuple[str, torch.Tensor]], model_dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """check_tensor over many tensors with one device sync: a trainer's bucket holds hundreds of expert
    tensors, and a sync per tensor was most of a colocated update's time. The sum of squares of a tensor
    (one fused multi-tensor kernel) is finite only if every value is; where it is not, the exact
    per-tensor rule decides (a huge finite weight can overflow the sum without being refused)."""
    for name, t in named:
        _check_dtype(name, t)
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (name, t) in enumerate(named):
        if t.dtype == torch.float8_e4m3fn:
            check_tensor(name, t, model_dtype)  # no fused norm for fp8: checked alone (rare: fp8 pushes)
        elif t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(i)
    for idx in by_kind.values():
        norms = torch._foreach_norm([named[i][1] for i in idx], 2)
        if not bool(torch.stack(norms).isfinite().all()):
            for i in idx:
                check_tensor(*named[i], model_dtype)
    return [(name, lossless_cast(name, t, model_dtype)) for name, t in named]


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise CheckpointError(
            f"weight {name!r} is {str(tensor.dtype).removeprefix('torch.')}; only floating point weights are loaded"
        )
    if tensor.dtype == torch.float8_e5m2 or (tensor.dtype.itemsize == 1 and tensor.dtype != torch.float8_e4m3fn):
        raise CheckpointError(f"weight {name!r} is {str(tensor.dtype).removeprefix('torch.')}; this engine loads "
                              "fp16, bf16, fp32 or fp64 weights, and float8_e4m3fn ones with their scales")


def lossless_cast(name: str, tensor: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """tensor.to(model_dtype) when no value changes (bf16 -> fp32, or fp32 holding bf16 values), else refused.

    An fp8 weight stays fp8 and a `*_scale_inv` scale becomes float32 (by the same rule): the model checked
    that they belong to fp8 layers (quantization/fp8_loading.py's check_update_dtypes)."""
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor
    if name.endswith(SCALE_SUFFIX):
        model_dtype = torch.float32
    if tensor.dtype == model_dtype:
        return tensor
    cast = tensor.to(model_dtype)
    if not torch.equal(cast.to(tensor.dtype), tensor):
        have, want = (str(d).removeprefix("torch.") for d in (tensor.dtype, model_dtype))
        raise CheckpointError(
            f"weight {name!r} is {have} and its values do not fit the model's {want} exactly; send {want} "
            "weights (the conversion would change the model the trainer trained)"
        )
    return cast
