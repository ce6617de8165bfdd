"""Engine configuration: one dataclass per concern, validated with messages that say what to change.

EngineConfig
  ├─ ModelConfig          checkpoint dir, dtype, architecture facts read from config.json
  ├─ CacheConfig          block_size, GPU/CPU/storage tiers
  ├─ SchedulerConfig      token budget, batch size, chunked prefill
  ├─ ParallelConfig       tensor / expert parallel sizes (config/parallel.py)
  └─ RoutingReplayConfig  R3 (r3/config.py); its derived shape comes from postprocess(model_config)

Every config is frozen: each is whole when constructed (ModelConfig reads config.json in __post_init__)
and nothing assigns to it afterwards. What changes while an engine runs is the engine's state, not
config: the max_model_len in force (lowered to what the KV cache holds) and the current weight version
live on EngineService (engine/engine_service.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from fastdeploy_r3.config.dtypes import MODEL_DTYPES
from fastdeploy_r3.config.hf_config import (
    SUPPORTED_ARCHITECTURES,
    GenerationDefaults,
    checkpoint_dtype,
    moe_layer_ids_from_hf_config,
    num_routed_experts_from_hf_config,
    read_hf_config,
    token_ids,
)
from fastdeploy_r3.config.parallel import (
    expert_parallel_size,
    read_expert_placement_file,
    validate_expert_parallel,
    validate_expert_parallel_flags,
    validate_tensor_parallel,
)
from fastdeploy_r3.config.quantization import QUANTIZATION_METHODS, QuantizationConfig, resolve_quantization
from fastdeploy_r3.config.scheduler_defaults import (
    DeviceBudget,
    kv_bytes_per_token,
    scheduler_defaults,
    weight_bytes_estimate,
)
from fastdeploy_r3.config.speculative import SpeculativeConfig
from fastdeploy_r3.errors import ConfigError
from fastdeploy_r3.r3.config import RoutingReplayConfig

_DTYPES = MODEL_DTYPES
# "auto": the dtype config.json says the weights were saved in
_DTYPE_CHOICES = (*_DTYPES, "auto")


def flag(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:  # noqa: A002
    """A config field that is also a CLI flag (config/cli.py derives `--name-with-dashes` from it)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def derived(**kwargs: Any) -> Any:
    """A field computed from other fields or from config.json: not a constructor argument, not a flag."""
    return field(init=False, **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(metadata={"help": "Hugging Face-format model directory (config.json + *.safetensors), or a "
                                 "Hub id (org/name) resolved through the Hugging Face cache (HF_HUB_OFFLINE=1: the "
                                 "cache only; the server resolves it, see config/hub.py)"})
    dtype: str = flag("float32", "dtype of the weights and activations ('auto': the dtype config.json names); "
                      "the KV cache follows it unless --kv-cache-dtype says otherwise", _DTYPE_CHOICES)
    quantization: str = flag("none", "how the weights are quantized (config/quantization.py): 'fp8' serves "
                                     "block-wise fp8 weights (quantizing an unquantized checkpoint at load and at "
                                     "every weight update); an fp8 checkpoint selects it by itself",
                             QUANTIZATION_METHODS)
    load_format: str = flag("auto", "'auto' reads *.safetensors; 'dummy' draws random weights from config.json",
                            ("auto", "dummy"))
    max_model_len: int | None = flag(None, "longest prompt + output in tokens (default: the model's "
                                           "max_position_embeddings, lowered to what the KV cache holds)")
    seed: int = flag(0, "seed of dummy weights")
    weight_version: str = flag("0", "version of the weights; part of the prefix-cache and storage-tier keys")
    tokenizer: str | None = field(default=None, metadata={"cli": False})  # the model directory unless set
    enforce_eager: bool = flag(False, "CUDA: no decode graphs (every step eager; worker/cuda_graph_runner.py)")
    enable_deterministic_inference: bool = flag(
        False, "batch-invariant kernels (SGLang's flag): a request gets the same tokens, logprobs and R3 rows "
        "alone, in any batch, chunked or from the prefix cache, at a cost in speed "
        "(model_executor/batch_invariant.py, docs/deterministic.md)")
    # read from config.json at construction (__post_init__)
    hf_config: dict[str, Any] = derived(default_factory=dict, repr=False)
    architecture: str = derived(default="")
    num_hidden_layers: int = derived(default=0)
    num_experts: int = derived(default=0)
    moe_top_k: int = derived(default=0)
    moe_layer_ids: list[int] = derived(default_factory=list)
    vocab_size: int = derived(default=0)
    eos_token_ids: list[int] = derived(default_factory=list)
    # generation_config.json's sampling fields under SamplingParams names (hf_config.GENERATION_DEFAULT_KEYS):
    # the defaults of a request that leaves them unset, as vLLM applies them
    generation_defaults: dict[str, Any] = derived(default_factory=dict)
    # config.json's quantization_config (method "none" when absent)
    quantization_config: QuantizationConfig = derived(default_factory=QuantizationConfig)

    def __post_init__(self) -> None:
        """Read config.json (normalized by hf_config) and generation_config.json, and validate: a ModelConfig
        is whole once constructed, and frozen from then on."""
        _set = partial(object.__setattr__, self)
        if self.dtype not in _DTYPE_CHOICES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {', '.join(_DTYPE_CHOICES)}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format {self.load_format!r} is not supported; use 'auto' or 'dummy'")
        if not os.path.isdir(self.model):
            raise ConfigError(
                f"model directory {self.model!r} does not exist; pass a Hugging Face-format directory "
                "(config.json + *.safetensors), e.g. one written by tools/make_fake_model.py"
            )
        hf = read_hf_config(self.model)
        _set("hf_config", hf)
        _set("architecture", hf["architectures"][0])
        _set("num_hidden_layers", int(hf["num_hidden_layers"]))
        _set("vocab_size", int(hf["vocab_size"]))
        _set("num_experts", num_routed_experts_from_hf_config(hf))
        _set("moe_top_k", int(hf.get("num_experts_per_tok", 0) or 0))
        _set("moe_layer_ids", moe_layer_ids_from_hf_config(hf))
        _set("quantization_config", QuantizationConfig.from_hf(hf))
        _set("quantization", resolve_quantization(self.quantization, self.quantization_config, self.model))
        if self.num_experts <= 0 or self.moe_top_k <= 0 or not self.moe_layer_ids:
            raise ConfigError(
                f"{self.model!r} is not a MoE model (no routed experts / experts per token / MoE layers); "
                "fastdeploy_r3 serves MoE models only"
            )
        if self.dtype == "auto":
            saved = checkpoint_dtype(hf)
            if saved not in _DTYPES:
                raise ConfigError(
                    f"dtype 'auto': config.json of {self.model!r} says the weights are {saved!r}; "
                    f"pass one of {', '.join(_DTYPES)} explicitly"
                )
            _set("dtype", saved)
        generation = GenerationDefaults.read(self.model)
        # vLLM: generation stops at config.json's eos ids and generation_config.json's (the tokenizer's
        # eos is added by the engine)
        _set("eos_token_ids", list(dict.fromkeys(token_ids(hf.get("eos_token_id")) + generation.eos_token_ids)))
        _set("generation_defaults", dict(generation.sampling))
        limit = int(hf["max_position_embeddings"])
        if self.max_model_len is None:
            _set("max_model_len", limit)
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} is too small; use at least 2")
        if self.tokenizer is None:
            _set("tokenizer", self.model)

    @property
    def model_identity(self) -> str:
        """Seeds the prefix-cache hash chain and namespaces the storage tier: fp8 weights (and the
        deterministic kernels) compute other KV than the same checkpoint unquantized, so the method is part
        of it (unquantized, default kernels: as before)."""
        method = "" if self.quantization == "none" else f":{self.quantization}"
        # the batch-invariant kernels compute other bits than the default ones: their KV must not mix
        mode = ":deterministic" if self.enable_deterministic_inference else ""
        return f"{self.architecture}:{os.path.abspath(self.model)}:{self.dtype}{method}{mode}"

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = flag(16, "tokens per KV block")
    num_gpu_blocks_override: int | None = flag(None, "number of device KV blocks, instead of sizing from memory")
    gpu_memory_utilization: float = flag(0.9, "fraction of GPU memory the worker may use (weights + KV)")
    kv_cache_space_gib: float = flag(0.25, "GiB of KV cache on a CPU-only machine")
    kv_cache_dtype: str = flag("auto", "dtype of the KV cache ('auto': the model's dtype, the only one supported "
                                       "so far)", ("auto", *MODEL_DTYPES))
    enable_prefix_caching: bool = flag(True, "reuse the KV (and R3 rows) of shared prompt prefixes")
    swap_space: float = flag(0.0, "GiB of CPU tier for swapped-out KV blocks, per worker rank")
    num_cpu_blocks_override: int | None = flag(None, "number of CPU-tier blocks, instead of --swap-space")
    kv_storage: str | None = flag(
        None,
        "storage tier below the CPU tier: file:///dir, redis://127.0.0.1:6379/0 or "
        "mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&protocol=tcp",
    )
    kv_storage_ttl_s: int = flag(86400, "a block in the storage tier expires this long after it was stored "
                                        "(Redis; a file tier drops it at its next read or capacity sweep)")
    kv_storage_capacity_gib: float | None = flag(None, "bytes a file storage tier may hold; past it the least "
                                                       "recently used blocks are removed (Redis: its maxmemory)")
    storage_timeout_s: float = flag(2.0, "deadline of one storage-tier lookup, load or put: past it the block is "
                                         "a miss (or is not stored) and the store counts as degraded until a probe "
                                         "answers")
    transfer_timeout_s: float = flag(30.0, "a cache transfer task without an ack this long means a stuck CTM: it "
                                           "is killed and replaced (its CPU tier is lost: misses, not errors)")
    pd_receiver: bool = field(default=False, metadata={"cli": False})  # PD: CacheTransferConfig.pd_receiver

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ConfigError(f"block_size={self.block_size}; use a value in [1, 1024] (16 is usual)")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(f"num_gpu_blocks_override={self.num_gpu_blocks_override}; use at least 2 blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization}; use a fraction in (0, 1]")
        if self.swap_space < 0:
            raise ConfigError(f"swap_space={self.swap_space}; use 0 (no CPU tier) or a positive size in GiB")
        if self.num_cpu_blocks_override is not None and self.num_cpu_blocks_override < 0:
            raise ConfigError(f"num_cpu_blocks_override={self.num_cpu_blocks_override}; use 0 or more")
        for name in ("storage_timeout_s", "transfer_timeout_s", "kv_storage_ttl_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}; use a positive number of seconds")
        if self.kv_storage_capacity_gib is not None and not self.kv_storage_capacity_gib > 0:
            raise ConfigError(f"kv_storage_capacity_gib={self.kv_storage_capacity_gib}; use a positive size or "
                              "leave it unset (no byte limit beyond kv_storage_ttl_s)")
        if self.kv_storage is not None and not self.kv_storage.startswith(("file://", "redis://", "mooncake://")):
            raise ConfigError(f"kv_storage={self.kv_storage!r}; use file:///absolute/dir, redis://127.0.0.1:6379/0 "
                              "or mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&protocol=tcp")

    @property
    def uses_transfer_manager(self) -> bool:
        """A CPU or storage tier exists, so the engine starts a CacheTransferManager."""
        return self.enable_prefix_caching and (self.has_cpu_tier or self.kv_storage is not None)

    @property
    def has_cpu_tier(self) -> bool:
        return bool(self.num_cpu_blocks_override) or (self.num_cpu_blocks_override is None and self.swap_space > 0)


@dataclass(frozen=True)
class SchedulerConfig:
    # None: what the device affords (config/scheduler_defaults.py), settled by EngineConfig
    max_num_seqs: int | None = flag(None, "most requests running in one step (default: 64 on CPU; on CUDA 256, "
                                          "capped by the KV cache)")
    max_num_batched_tokens: int | None = flag(None, "most tokens forwarded in one step (default: 2048 on CPU; "
                                                    "on CUDA 8192, capped by the KV cache)")
    enable_chunked_prefill: bool = flag(True, "split long prompts over several steps")
    disable_overlap_schedule: bool = flag(
        False, "schedule and build each step only after the previous one's tokens are back, instead of "
        "while the workers run it (SGLang's flag; engine/overlap.py)"
    )
    max_waiting_requests: int = flag(
        1024, "most requests (choices of n > 1 count one each) waiting to be scheduled; the server answers "
        "429 with Retry-After beyond it"
    )

    def validate(self, max_model_len: int) -> None:
        """Called once both sizes are settled (EngineConfig fills what was left unset)."""
        assert self.max_num_seqs is not None and self.max_num_batched_tokens is not None
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs}; use at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens}; use at least 1")
        if self.max_waiting_requests < 1:
            raise ConfigError(f"max_waiting_requests={self.max_waiting_requests}; use at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({max_model_len}); raise it, lower max_model_len or enable chunked prefill"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = flag(1, "worker processes the model is sharded over (gloo on CPU, NCCL on CUDA)")
    worker_step_timeout_s: float = flag(120.0, "a step the workers have not answered this long (a stuck or stopped "
                                               "worker) fails the engine, which exits so its supervisor restarts it")
    enable_expert_parallel: bool = flag(False, "each of the tensor-parallel ranks holds whole routed experts (a "
                                               "contiguous 1/N of them) instead of 1/N of every expert")
    ep_size: int = flag(1, "expert-parallel size; 1, or the tensor-parallel size (same as --enable-expert-parallel)")
    expert_placement_file: str | None = flag(None, "EPLB: JSON {\"physical_to_logical\": [...]}, the logical expert "
                                                   "of each physical slot (replicas of hot experts), P/N per rank")
    ep_num_redundant_experts: int = flag(0, "EPLB: R extra expert slots (R/N per rank) for replicas of hot experts")
    moe_a2a_backend: str = flag("local", "expert parallelism's token dispatch: local (every rank keeps the rows of its "
                                         "experts, one all-reduce) or alltoall (rows to their expert's rank and back)",
                                choices=("local", "alltoall"))

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size}; use at least 1")
        if not self.worker_step_timeout_s > 0:
            raise ConfigError(f"worker_step_timeout_s={self.worker_step_timeout_s}; use a positive number of seconds")
        assert self.expert_parallel_size >= 1  # refuses an ep_size the TP size does not allow
        validate_expert_parallel_flags(self.moe_a2a_backend, self.expert_parallel_size, self.ep_num_redundant_experts,
                                       self.expert_placement_file)

    @property
    def expert_parallel_size(self) -> int:
        """1, or the TP size: each rank then holds whole experts (config/parallel.py)."""
        return expert_parallel_size(self.tensor_parallel_size, self.enable_expert_parallel, self.ep_size)

    def validate_for_model(self, hf_config: dict[str, Any]) -> None:
        ep = self.expert_parallel_size
        validate_tensor_parallel(hf_config, self.tensor_parallel_size, expert_parallel=ep > 1)
        validate_expert_parallel(hf_config, ep)
        if self.expert_placement_file is not None:
            read_expert_placement_file(self.expert_placement_file, num_routed_experts_from_hf_config(hf_config), ep)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    routing_replay_config: RoutingReplayConfig = field(
        default_factory=RoutingReplayConfig,
        metadata={"help": "R3 settings: a JSON object or the path of a JSON file (keys: see README)", "type": str},
    )
    device: str = flag("auto", "where the workers run; auto picks cuda when available", ("auto", "cpu", "cuda"))
    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "help": 'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
                '"prompt_lookup_min": 1, "prompt_lookup_max": 4} (config/speculative.py)', "type": str})

    def __post_init__(self) -> None:
        # each part's checks, those that span parts, and the two fields that depend on others (the R3
        # shape, the device), settled here before anyone holds the config
        mc = self.model_config
        if self.device == "auto":
            import torch

            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}; use 'cpu', 'cuda' or 'auto'")
        self.cache_config.validate()
        self._settle_scheduler_sizes()
        self.scheduler_config.validate(self.max_model_len)
        self.parallel_config.validate()
        self.parallel_config.validate_for_model(mc.hf_config)
        if self.speculative_config is not None:
            tp = self.parallel_config.tensor_parallel_size
            self.speculative_config.validate_for_model(mc.model, mc.hf_config, tp)
        kv_dtype = mc.dtype if self.cache_config.kv_cache_dtype == "auto" else self.cache_config.kv_cache_dtype
        if kv_dtype != mc.dtype:
            raise ConfigError(f"kv_cache_dtype={kv_dtype!r} differs from the model dtype {mc.dtype!r}; a KV cache "
                              "in another dtype needs a KV quantization method this engine lacks: use 'auto'")
        object.__setattr__(self, "cache_config", replace(self.cache_config, kv_cache_dtype=kv_dtype))
        rr = self.routing_replay_config
        rr.validate()
        if rr.moe_layer_ids is None:
            object.__setattr__(self, "routing_replay_config", rr.postprocess(mc))

    def _settle_scheduler_sizes(self) -> None:
        """max_num_seqs / max_num_batched_tokens left unset: what the device affords; a given one stays."""
        sc = self.scheduler_config
        if sc.max_num_seqs is not None and sc.max_num_batched_tokens is not None:
            return
        seqs, tokens = scheduler_defaults(self.device_budget(), self.max_model_len, sc.enable_chunked_prefill)
        object.__setattr__(self, "scheduler_config", replace(
            sc, max_num_seqs=sc.max_num_seqs if sc.max_num_seqs is not None else seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens if sc.max_num_batched_tokens is not None else tokens))

    def device_budget(self) -> DeviceBudget:
        """What the scheduler defaults are derived from: this device's memory, the model's sizes."""
        if self.device != "cuda":
            return DeviceBudget("cpu")
        import torch

        mc, cc, tp = self.model_config, self.cache_config, self.parallel_config.tensor_parallel_size
        dtype_bytes = torch.empty(0, dtype=getattr(torch, mc.dtype)).element_size()
        return DeviceBudget(
            "cuda", memory_bytes=torch.cuda.get_device_properties(0).total_memory,
            memory_utilization=cc.gpu_memory_utilization,
            weight_bytes=weight_bytes_estimate(mc.hf_config, mc.moe_layer_ids, dtype_bytes, tp),
            kv_bytes_per_token=kv_bytes_per_token(mc.hf_config, dtype_bytes, tp), block_size=cc.block_size,
            num_gpu_blocks_override=cc.num_gpu_blocks_override,
        )

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (the names of the CLI flags with underscores)."""
        parts: dict[type, dict[str, Any]] = {c: {} for c in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)}
        owners = {f.name: c for c in parts for f in dataclasses.fields(c) if f.init}
        engine_kw: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key == "routing_replay_config":
                engine_kw[key] = RoutingReplayConfig.from_json(value)
            elif key == "speculative_config":
                engine_kw[key] = SpeculativeConfig.from_json(value)
            elif key == "device":
                engine_kw[key] = value
            elif key in owners:
                parts[owners[key]][key] = value
            else:
                raise ConfigError(f"unknown engine argument {key!r}; see `fastdeploy-r3 serve --help` for the flags")
        return cls(
            model_config=ModelConfig(model=model, **parts[ModelConfig]),
            cache_config=CacheConfig(**parts[CacheConfig]),
            scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
            parallel_config=ParallelConfig(**parts[ParallelConfig]),
            **engine_kw,
        )

    @property
    def max_model_len(self) -> int:
        """What was asked for (or the model's limit). The engine may serve less when its KV cache holds
        fewer tokens: EngineService.max_model_len is the limit in force."""
        assert self.model_config.max_model_len is not None
        return self.model_config.max_model_len

