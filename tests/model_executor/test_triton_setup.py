"""One Triton shim: every kernel module takes triton from ops/triton_setup.py, so one interpret rule
decides for all of them (no module runs its kernel interpreted while another silently takes torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "fastdeploy_r3"
SHIM = PACKAGE / "model_executor" / "ops" / "triton_setup.py"


def _imports_triton(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "triton":
            return True
    return False


def test_only_the_shim_imports_triton() -> None:
    importers = sorted(str(p.relative_to(REPO_ROOT)) for p in PACKAGE.rglob("*.py") if _imports_triton(p))
    assert importers == [str(SHIM.relative_to(REPO_ROOT))]


@pytest.mark.parametrize(("value", "interpreted"), [("true", True), ("0", False)])
def test_one_interpret_rule_for_attention_moe_alignment_and_r3_capture(value: str, interpreted: bool) -> None:
    """TRITON_INTERPRET=true (a value triton itself accepts): the attention, MoE-alignment, R3-capture and
    fused-routing kernels all run interpreted on CPU tensors; with 0 all four take their torch references."""
    pytest.importorskip("triton")
    body = textwrap.dedent(f"""
        import os
        os.environ["TRITON_INTERPRET"] = {value!r}
        import torch
        from triton.runtime.interpreter import InterpretedFunction
        from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
        from fastdeploy_r3.model_executor.layers.attention import Attention
        from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
        from fastdeploy_r3.model_executor.ops import fused_routing, moe_align, paged_prefill, routing_capture_kernel
        from fastdeploy_r3.model_executor.ops import triton_setup

        kernels = (paged_prefill._prefill_kernel, moe_align._align_kernel,
                   routing_capture_kernel._capture_topk_ids_kernel, fused_routing._fused_routing_kernel)
        calls = []
        for kernel in kernels:
            kernel.run = (lambda run, name: lambda *a, **k: (calls.append(name), run(*a, **k))[1])(
                kernel.run, kernel.fn.__name__)
        # attention: a 10-token prompt in blocks 1, 2, 0 of a 3-block cache of 4-token blocks (longer
        # than the decode kernel's short-query rows: the prefill kernel)
        q, k = torch.randn(10, 2, 4), torch.randn(10, 1, 4)
        cache = (torch.zeros(3, 4, 1, 4), torch.zeros(3, 4, 1, 4))
        slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 0, 1])
        meta = AttentionMetadata(slots, [0, 10], [10], [10], torch.tensor([[1, 2, 0]]), 4)
        with set_forward_context(ForwardContext(meta, [cache])):
            Attention(2, 1, 4, 0.5, layer_idx=0)(q, k, k)
        assert torch.equal(cache[0].reshape(12, 1, 4)[slots], k)
        # MoE alignment: T=2, K=2, 3 experts, BM 4
        ids = torch.tensor([[2, 0], [2, 1]])
        blocks = moe_align.align_to_blocks(ids, num_experts=3, block_m=4)
        assert blocks.sorted_ids[:12].tolist() == [1, 4, 4, 4, 3, 4, 4, 4, 0, 2, 4, 4]
        # R3 capture into MoE layer 0 of a 4-token step buffer
        buffer = torch.zeros(4, 1, 2, dtype=torch.int32)
        routing_capture_kernel.capture_topk_ids_dispatch(buffer, 0, ids)
        assert buffer[:2, 0].tolist() == [[2, 0], [2, 1]]
        # a MoE layer's routing: 2 tokens, 4 experts, top-2 (the experts themselves: the CPU loop either way)
        block = SparseMoeBlock(8, 4, 2, 4, moe_index=0)
        for p in block.parameters():
            torch.nn.init.normal_(p)
        with set_forward_context(ForwardContext(None, [])):
            block(torch.randn(2, 8))

        assert triton_setup.INTERPRET is {interpreted}
        assert all(isinstance(kernel, InterpretedFunction) for kernel in kernels) is {interpreted}
        expected = ["_prefill_kernel", "_align_kernel", "_capture_topk_ids_kernel", "_fused_routing_kernel"]
        expected = expected if {interpreted} else []
        assert calls == expected, calls
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", body], check=False, capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


def test_programmatic_dependent_launch_stays_off_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """pdl(x) (launch early, wait for inputs: ops/triton_setup.py) holds only for compiled kernels on a
    Hopper-or-later GPU with PDL_ENABLED: never for CPU tensors (interpreted or torch), never with the
    switch off, whatever the device says."""
    import torch

    from fastdeploy_r3.model_executor.ops import triton_setup

    assert not triton_setup.pdl(torch.zeros(1))
    fake_cuda = type("FakeCuda", (), {"is_cuda": True, "device": torch.device("cuda", 0)})()
    monkeypatch.setattr(triton_setup, "_hopper_or_later", lambda index: True)
    monkeypatch.setattr(triton_setup, "INTERPRET", False)
    monkeypatch.setattr(triton_setup, "PDL_ENABLED", False)
    assert not triton_setup.pdl(fake_cuda)
    monkeypatch.setattr(triton_setup, "PDL_ENABLED", True)
    assert triton_setup.pdl(fake_cuda) is (triton_setup.gdc_wait is not None)
    monkeypatch.setattr(triton_setup, "INTERPRET", True)
    assert not triton_setup.pdl(fake_cuda)
