"""The engine CI validates on CPU gives the same answers on CUDA, the CPU swap tier and storage included.

CI has no GPU: tests/gpu/conftest.py skips these there. They run through the device tool (an H200):

    python -m pytest -m gpu tests/gpu -v -s

Tiny qwen3_moe, float32, block_size 4; 12 prompts sharing three 24-token prefixes (as in
tests/engine/test_cache_tiers.py), 6 greedy tokens each.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from fake_model import make_fake_model
from router_probe import cpu_router_logits

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.cache_manager.cache_transfer_client import CacheTransferClient
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import new_engine_suffix, shm_name, unlink_all
from fastdeploy_r3.cache_manager.transfer import CacheTransferConfig, KVCacheSpec, TransferKind, TransferTask

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
NEAR_TIE = 1e-4  # a router K-th / (K+1)-th probability gap below this may flip between CPU and GPU kernels


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_fake_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-tiny")), preset="tiny", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    bases = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(3)]
    return [bases[i % 3] + [rng.randrange(3, 500) for _ in range(1 + i % 4)] for i in range(12)]


def generate(model_dir: str, prompts: list[list[int]], device: str, debug: bool = False, **kw: object):
    """(tokens, R3 rows, metrics) of a greedy run; every request must succeed."""
    r3 = {"enable_routing_replay": True, "debug_mode": debug}
    with LLM(model_dir, device=device, dtype="float32", block_size=4, max_num_seqs=2, routing_replay_config=r3,
             **kw) as llm:  # fmt: skip
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs], metrics


@pytest.fixture(scope="module")
def cuda_reference(model_dir: str, prompts: list[list[int]]):
    return generate(model_dir, prompts, "cuda", num_gpu_blocks_override=256)


def router_gaps(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """[T, L]: per token and MoE layer, the smallest gap between adjacent router probabilities among the
    K + 1 best (CPU float32 forward without KV cache); a small gap means the top-k set or order is a near-tie."""
    gaps = []
    for m, logits in cpu_router_logits(model_dir, token_ids):
        top = torch.softmax(logits.float(), dim=-1).topk(m.top_k + 1, dim=-1).values  # [T, K+1]
        gaps.append((top[:, :-1] - top[:, 1:]).min(dim=-1).values.numpy())  # [T]
    return np.stack(gaps, axis=1)


def test_greedy_tokens_and_r3_rows_on_cuda_equal_cpu(model_dir, prompts, cuda_reference) -> None:
    """Same prompts on CPU and CUDA (float32): identical tokens; R3 rows identical except router near-ties."""
    cpu_tokens, cpu_rows, _ = generate(model_dir, prompts, "cpu", num_gpu_blocks_override=256)
    cuda_tokens, cuda_rows, _ = cuda_reference
    assert cuda_tokens == cpu_tokens
    checked, mismatched = 0, []
    for i, (c, g) in enumerate(zip(cpu_rows, cuda_rows, strict=True)):
        assert g.shape == c.shape and g.dtype == c.dtype
        differ = (g != c).any(axis=2)  # [rows, L]
        checked += len(differ)
        bad = np.nonzero(differ.any(axis=1))[0]
        if len(bad):
            gaps = router_gaps(model_dir, prompts[i] + cpu_tokens[i][:-1])[differ]
            mismatched.append((i, bad.tolist(), float(gaps.max())))
            assert (gaps < NEAR_TIE).all(), f"prompt {i}: rows {bad.tolist()} differ, router gaps {gaps}"
    print(f"\nR3 rows CUDA vs CPU: {sum(len(b) for _, b, _ in mismatched)}/{checked} rows differ "
          f"(all near-ties): {mismatched}")  # fmt: skip


def test_cpu_tier_on_cuda_swaps_out_and_in(model_dir, prompts, cuda_reference) -> None:
    """16 GPU blocks hold two requests: prefixes go to the pinned CPU tier and back through CUDA IPC; tokens
    equal the big-cache run and debug-mode rows equal the token positions."""
    tokens, rows, m = generate(model_dir, prompts, "cuda", debug=True,
                               num_gpu_blocks_override=16, num_cpu_blocks_override=64)  # fmt: skip
    assert tokens == cuda_reference[0]
    assert m["swap_out_blocks"] > 0 and m["swap_in_blocks"] > 0, m
    for r in rows:
        pos = (np.arange(len(r)) % 255).astype(r.dtype)
        assert np.array_equal(r, np.broadcast_to(pos[:, None, None], r.shape))
    print(f"\nswap on CUDA: {m['swap_out_blocks']} blocks out, {m['swap_in_blocks']} in")


def test_storage_tier_on_cuda(model_dir, prompts, cuda_reference, tmp_path) -> None:
    """No CPU tier, file storage: evicted prefixes are written from and loaded back into device memory."""
    tokens, _, m = generate(model_dir, prompts, "cuda", num_gpu_blocks_override=16, kv_storage=f"file://{tmp_path}")
    assert tokens == cuda_reference[0]
    assert m["storage_put_blocks"] > 0 and m["storage_load_blocks"] > 0, m


def test_ctm_moves_exact_bytes_between_cuda_kv_pinned_tier_and_storage(tmp_path) -> None:
    """KV made here, shared with the CTM through CUDA IPC: blocks [1, 2, 5] -> CPU [3, 4, 0] -> GPU [6, 7, 0],
    and block 1 -> storage -> GPU 3, byte for byte, each with its routing rows."""
    bs, nb = 4, 8
    shape = (2, 2, nb, bs, 2, 8)  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    kv = torch.randn(shape, device="cuda").to(torch.bfloat16)
    suffix = new_engine_suffix()
    host_spec = RoutingBufferSpec(shm_name(suffix, "routing_host"), nb * bs, 3, 2, "uint8")
    host = RoutingBuffer.create(host_spec)
    host.rows[:] = np.random.default_rng(0).integers(0, 200, host.rows.shape, dtype=np.uint8)
    host.tags[:] = 5
    from torch.multiprocessing.reductions import reduce_tensor

    config = CacheTransferConfig(
        kv_specs=[KVCacheSpec("kv", shape, "bfloat16", device="cuda", cuda_ipc=reduce_tensor(kv))],
        num_cpu_blocks=6,
        block_size=bs,
        routing_host=host_spec,
        routing_swap_name=shm_name(suffix, "routing_swap"),
        kv_cpu_name=shm_name(suffix, "kv_cpu"),
        storage_url=f"file://{tmp_path}",
        storage_namespace="gpu-test",
        parent_pid=os.getpid(),
    )
    before = kv.clone()
    rows_before = host.rows.copy()
    client = CacheTransferClient()
    client.start(config)
    try:
        tasks = [
            TransferTask(1, TransferKind.SWAP2CPU, [1, 2, 5], cpu_block_ids=[3, 4, 0]),
            TransferTask(2, TransferKind.SWAP2GPU, [6, 7, 0], cpu_block_ids=[3, 4, 0]),
            TransferTask(3, TransferKind.GPU2STORAGE, [1], storage_keys=["ab" * 16], routing_tags=[5]),
            TransferTask(4, TransferKind.STORAGE2GPU, [3], storage_keys=["ab" * 16], routing_tags=[9]),
        ]
        for t in tasks:
            client.submit(t)
            ack = client.wait(t.task_id)
            assert ack.ok, ack.error
    finally:
        client.shutdown()
    try:
        for src, dst in [(1, 6), (2, 7), (5, 0), (1, 3)]:
            assert torch.equal(kv[:, :, dst], before[:, :, src]), (src, dst)
            assert np.array_equal(host.rows[dst * bs : (dst + 1) * bs], rows_before[src * bs : (src + 1) * bs])
        assert torch.equal(kv[:, :, [2, 4, 5]], before[:, :, [2, 4, 5]])  # untouched blocks stay
        assert (host.tags[3 * bs : 4 * bs] == 9).all()
    finally:
        host.close()
        unlink_all(suffix)
