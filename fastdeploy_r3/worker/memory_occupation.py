"""Release and resume a worker's memory for colocated training (SGLang's /release_memory_occupation):
the trainer takes the device while the engine sleeps.

    tag        release                                   resume
    kv_cache   drop the decode graphs (they point into   allocate the cache again (zeros) and capture
               the cache), free the cache                the graphs again: an empty cache
    weights    every parameter's storage freed; shapes   allocate every parameter again (zeros): the
               and dtypes kept                           model holds no weights until an update fills
                                                         it (the engine refuses requests until then)

On CUDA the bytes go back to the device (`torch.cuda.empty_cache`), on the CPU to the host (the KV
cache's shared-memory segment is unlinked, parameters' storage freed). Nothing is kept elsewhere: a
released state has no contents, which is what colocated RL wants (the trainer pushes new weights after
resume) and why the engine treats resumed weights as missing.
"""

from __future__ import annotations

import gc
import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fastdeploy_r3.worker.model_runner import ModelRunner


class MemoryOccupation:
    """What of one rank is released, and what it takes to bring it back."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_gpu_blocks: int | None = None  # set when the KV cache is released
        self.param_specs: dict[str, tuple[torch.Size, torch.dtype]] | None = None  # set when weights are released

    def release(self, tags: list[str]) -> int:
        """Free `tags`; returns the bytes freed. Releasing what is already released frees nothing."""
        freed = 0
        if "kv_cache" in tags and self.num_gpu_blocks is None:
            freed += self._release_kv_cache()
        if "weights" in tags and self.param_specs is None:
            freed += self._release_weights()
        gc.collect()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def resume(self, tags: list[str]) -> int:
        """Allocate `tags` again (weights first: graphs are captured over the model); returns the bytes."""
        allocated = 0
        if "weights" in tags and self.param_specs is not None:
            allocated += self._resume_weights()
        if "kv_cache" in tags and self.num_gpu_blocks is not None:
            allocated += self._resume_kv_cache()
        return allocated

    def _release_kv_cache(self) -> int:
        r = self.runner
        assert r.kv_cache is not None
        nbytes = r.kv_cache.numel() * r.kv_cache.element_size()
        self.num_gpu_blocks = r.kv_cache.shape[2]
        r.decode_graphs = None  # its static buffers hold views of the cache
        r.kv_cache = None
        r.drafter = None  # and the MTP draft layer's own cache: init_kv_cache makes a new drafter on resume
        if r._kv_segment is not None:
            r._kv_segment.close()  # the owner unlinks: /dev/shm gets the bytes back
            r._kv_segment = None
        return nbytes

    def _resume_kv_cache(self) -> int:
        r = self.runner
        assert self.num_gpu_blocks is not None
        r.init_kv_cache(self.num_gpu_blocks)
        self.num_gpu_blocks = None
        if self.param_specs is None:  # graphs are captured over the weights: not while they are released
            r.capture_decode_graphs()
        assert r.kv_cache is not None
        return r.kv_cache.numel() * r.kv_cache.element_size()

    def _release_weights(self) -> int:
        model = self.runner.model
        assert model is not None
        self.runner.decode_graphs = None  # graphs read the parameters' addresses
        specs, freed = {}, 0
        for name, p in model.named_parameters():
            specs[name] = (p.shape, p.dtype)
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.param_specs = specs
        return freed

    def _resume_weights(self) -> int:
        model = self.runner.model
        assert model is not None and self.param_specs is not None
        allocated = 0
        for name, p in model.named_parameters():
            shape, dtype = self.param_specs[name]
            p.data = torch.zeros(shape, dtype=dtype, device=p.device)
            allocated += p.numel() * p.element_size()
        self.param_specs = None
        if self.runner.kv_cache is not None:
            self.runner.capture_decode_graphs()
        return allocated


def weights_checksums(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of the bytes of every parameter (this rank's shard), by the engine's parameter name."""
    out = {}
    for name, p in model.named_parameters():
        raw = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # [bytes]
        out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out
