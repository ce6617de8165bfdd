"""The fused routing kernel (ops/fused_routing.py) against the torch routers of layers/moe.py, run by the
real Triton interpreter on tiny shapes: ids, weights, per-expert counts, the experts' alignment and the
R3 capture rows, for Qwen3 (softmax, with and without norm_topk_prob), Mixtral (softmax, renormalised)
and GLM-4.5 (sigmoid + bias, group-limited, scaled), float32 and bfloat16 logits.

TRITON_INTERPRET must be set before triton builds the kernels, so the kernel scenarios run in a fresh
interpreter process (one per test: the interpreter's import is the expensive part).
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import run_interpreted

from fastdeploy_r3.model_executor.layers.moe import grouped_sigmoid_topk, softmax_topk

PRELUDE = """
import torch
from triton.runtime.interpreter import InterpretedFunction
from fastdeploy_r3.model_executor.layers.moe import grouped_sigmoid_topk, softmax_topk
from fastdeploy_r3.model_executor.ops import fused_routing as fr
from fastdeploy_r3.model_executor.ops.fused_routing import RouterSpec, fused_routing
from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks_torch
assert isinstance(fr._fused_routing_kernel, InterpretedFunction)  # really the kernel, not a reference
launches = []
for kernel in (fr._fused_routing_kernel, fr._align_partials_kernel):
    kernel.run = (lambda run, name: lambda *a, **k: (launches.append(name), run(*a, **k))[1])(
        kernel.run, kernel.fn.__name__)

def reference(logits, spec, bias):
    if spec.scoring == "softmax":
        return softmax_topk(logits, spec.top_k, spec.renormalize)
    return grouped_sigmoid_topk(logits, spec.top_k, bias, spec.n_group, spec.topk_group, spec.renormalize,
                                spec.routed_scaling_factor)
"""


def _run_interpreted(body: str) -> None:
    run_interpreted(body, PRELUDE)


def test_reference_routers_rank_ties_by_lower_expert_id() -> None:
    """The rule both sides follow: four experts tied at the top of 128 come out 5, 7, 60, 100 (torch.topk
    alone gives 60, 7, 100, 5 on the CPU); GLM keeps the lower of two tied groups."""
    logits = torch.zeros(1, 128)
    logits[0, [100, 60, 7, 5]] = 4.0
    weights, ids = softmax_topk(logits, 6, renormalize=False)
    assert ids.tolist() == [[5, 7, 60, 100, 0, 1]]
    assert weights[0, 0] == weights[0, 3] and weights[0, 4] == weights[0, 5]
    # 8 experts in 4 groups of 2; groups 1, 2 and 3 tie (scores 1 + 1), group 0 is lower: keep groups 1, 2
    glm = torch.tensor([[-3.0, -3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    _, ids = grouped_sigmoid_topk(glm, 4, torch.zeros(8), n_group=4, topk_group=2, renormalize=True,
                                  routed_scaling_factor=1.0)  # fmt: skip
    assert ids.tolist() == [[2, 3, 4, 5]]


def test_kernel_equals_the_torch_routers_for_three_gatings_two_dtypes_and_both_launch_paths() -> None:
    """Random logits, 1 token (decode, one launch) and 19 (> the 16-token tile: two tiles, two partial rows;
    both launch paths), every
    gating family: ids and counts bit-exact, weights within 1e-6 (the sums run in another order), the
    alignment equal to align_to_blocks_torch, the capture rows equal to the ids."""
    _run_interpreted("""
        torch.manual_seed(0)
        E, K = 16, 4
        bias = torch.randn(E) * 0.5
        specs = {
            "qwen3 norm_topk_prob": RouterSpec(K, "softmax", renormalize=True),
            "qwen3 without norm_topk_prob": RouterSpec(K, "softmax", renormalize=False),
            "mixtral (top-2, renormalised)": RouterSpec(2, "softmax", renormalize=True),
            "glm grouped": RouterSpec(K, "sigmoid", True, n_group=4, topk_group=2, routed_scaling_factor=2.5),
            "glm one group, no renorm": RouterSpec(K, "sigmoid", False, routed_scaling_factor=1.0),
        }
        for T in (1, 19):
            for dtype in (torch.float32, torch.bfloat16):
                logits = (torch.randn(T, E) * 2).to(dtype)
                for name, spec in specs.items():
                    for one_launch in (True, False) if T > 1 else (None,):
                        case = (name, T, dtype, one_launch)
                        buffer = torch.full((24, 3, spec.top_k), -1, dtype=torch.int32)  # [max_tokens, L, K]
                        got = fused_routing(logits, spec, bias if spec.scoring == "sigmoid" else None, buffer,
                                            moe_index=2, block_m=4, one_launch=one_launch)
                        weights, ids = reference(logits, spec, bias)
                        assert torch.equal(got.topk_ids, ids), case
                        torch.testing.assert_close(got.topk_weights, weights, rtol=1e-6, atol=1e-7, msg=str(case))
                        assert got.counts.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist(), case
                        assert torch.equal(buffer[:T, 2].long(), ids) and (buffer[T:] == -1).all(), case
                        assert (buffer[:, :2] == -1).all(), case  # the other layers' rows untouched
                        want = align_to_blocks_torch(ids, E, 4)
                        n = int(want.num_padded)
                        assert int(got.blocks.num_padded) == n, case
                        # the interpreter runs the atomics in lane order: the stable torch order exactly
                        assert torch.equal(got.blocks.sorted_ids[:n], want.sorted_ids[:n]), case
                        assert torch.equal(got.blocks.block_expert[: n // 4], want.block_expert[: n // 4]), case
        # one launch for a decode batch, two (routing, then alignment) when forced apart
        launches.clear()
        fused_routing(torch.randn(3, E), specs["mixtral (top-2, renormalised)"], block_m=4)
        assert launches == ["_fused_routing_kernel"], launches
        launches.clear()
        fused_routing(torch.randn(3, E), specs["mixtral (top-2, renormalised)"], block_m=4, one_launch=False)
        assert launches == ["_fused_routing_kernel", "_align_partials_kernel"], launches
    """)


def test_a_few_tokens_without_an_alignment_route_a_program_each_with_the_bits_each_gets_alone() -> None:
    """A verify step's 4 tokens for the GEMV experts (no block_m): one launch of 4 programs, no partial-count
    launch; each token's ids and weights are, bit for bit, the ones it gets routed alone, for a softmax and a
    grouped sigmoid router; the counts (summed when asked) are the ids' histogram; the padded token's
    capture row stays as it was. 5 tokens (past PER_TOKEN_MAX_TOKENS) take the one-program path again."""
    _run_interpreted("""
        torch.manual_seed(5)
        E = 16
        bias = torch.randn(E) * 0.5
        specs = (RouterSpec(4, "softmax", renormalize=True),
                 RouterSpec(4, "sigmoid", True, n_group=4, topk_group=2, routed_scaling_factor=2.5))
        assert fr.PER_TOKEN_MAX_TOKENS == 4
        for spec in specs:
            b = bias if spec.scoring == "sigmoid" else None
            logits = torch.randn(4, E) * 2
            buffer = torch.full((6, 2, 4), 77, dtype=torch.int32)
            launches.clear()
            got = fused_routing(logits, spec, b, buffer, moe_index=1, slot_mapping=torch.tensor([3, 4, 5, -1]))
            assert launches == ["_fused_routing_kernel"], launches
            assert got.count_rows.shape == (4, E), got.count_rows.shape
            weights, ids = reference(logits, spec, b)
            assert torch.equal(got.topk_ids, ids), spec
            torch.testing.assert_close(got.topk_weights, weights, rtol=1e-6, atol=1e-7)
            for t in range(4):
                alone = fused_routing(logits[t : t + 1], spec, b)
                assert torch.equal(got.topk_ids[t], alone.topk_ids[0]), (spec, t)
                assert torch.equal(got.topk_weights[t], alone.topk_weights[0]), (spec, t)
            assert got.counts.tolist() == torch.bincount(ids.flatten(), minlength=E).tolist()
            assert torch.equal(buffer[:3, 1].long(), ids[:3]) and (buffer[3:] == 77).all()
            assert (buffer[:, 0] == 77).all()  # the other layer's rows
        launches.clear()
        five = fused_routing(torch.randn(5, E), specs[0])
        assert launches == ["_fused_routing_kernel"] and five.count_rows.shape == (1, E), launches
        assert five.counts.sum().item() == 5 * 4
    """)


def test_kernel_breaks_ties_by_lower_id_and_leaves_padded_tokens_rows_alone() -> None:
    """Ties built on purpose, in float32 and bf16: all-equal logits pick experts 0..K-1, a tie at the k-th
    place keeps the lower id, GLM keeps the lower of three tied groups. Token 3 is a CUDA graph's padding
    (slot -1): its capture row keeps what it held, while its ids still count for the experts."""
    _run_interpreted("""
        E = 8
        logits = torch.tensor([
            [0.0] * 8,                                   # all tied: 0, 1, 2
            [1.0, 0.0, 2.0, 0.0, 0.0, 2.0, 0.0, 1.0],    # 2 and 5 tie first, 0 and 7 tie for the third place
            [-1.0, 3.0, -1.0, -1.0, 3.0, 3.0, 3.0, -1.0],  # four tie for three places: 1, 4, 5
            [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],    # padding: routed, counted, never captured
        ])
        slots = torch.tensor([12, 13, 14, -1])
        for dtype in (torch.float32, torch.bfloat16):
            buffer = torch.full((6, 1, 3), 99, dtype=torch.int32)
            got = fused_routing(logits.to(dtype), RouterSpec(3, "softmax", renormalize=True), None, buffer,
                                slot_mapping=slots, block_m=2)
            assert got.topk_ids.tolist() == [[0, 1, 2], [2, 5, 0], [1, 4, 5], [0, 1, 2]], dtype
            assert torch.equal(got.topk_ids, reference(logits.to(dtype), RouterSpec(3), None)[1])
            assert buffer[:3, 0].tolist() == [[0, 1, 2], [2, 5, 0], [1, 4, 5]], dtype
            assert buffer[3:].eq(99).all(), "a padded token wrote a capture row"
            assert got.counts.tolist() == [3, 3, 3, 0, 1, 2, 0, 0], dtype
            torch.testing.assert_close(got.topk_weights[0], torch.full((3,), 1 / 3))
        # GLM: groups of 2; groups 1, 2, 3 tie (1 + 1 each), group 0 is lower: groups 1 and 2 are kept
        glm = torch.tensor([[-3.0, -3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
        spec = RouterSpec(4, "sigmoid", True, n_group=4, topk_group=2, routed_scaling_factor=1.0)
        got = fused_routing(glm, spec, torch.zeros(E))
        assert got.topk_ids.tolist() == [[2, 3, 4, 5]]
        torch.testing.assert_close(got.topk_weights, torch.full((1, 4), 0.25))
    """)


def test_moe_block_routes_through_the_kernel_into_the_routing_capture() -> None:
    """A Qwen3 and a GLM block under the interpreter take the fused path (one routing launch per layer):
    the RoutingCapture's step rows equal route()'s ids (the CPU reference), the padded token's row stays
    zero, the layer counts as captured, and the Triton experts reuse the kernel's alignment (no
    separate alignment launch) with the loop's output."""
    _run_interpreted("""
        import numpy as np
        from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
        from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock, loop_experts
        from fastdeploy_r3.model_executor.ops import moe_align
        from fastdeploy_r3.worker.routing_capture import RoutingCapture

        aligns = []
        moe_align._align_kernel.run = (lambda run: lambda *a, **k: (aligns.append(1), run(*a, **k))[1])(
            moe_align._align_kernel.run)
        torch.manual_seed(0)
        T = 5  # 4 real tokens and one padded (slot -1)
        meta = AttentionMetadata(torch.tensor([8, 9, 10, 11, -1]), [0, 5], [5], [5], torch.zeros(1, 1), 4)
        blocks = {"qwen3": dict(router="softmax", renormalize=False),
                  "glm": dict(router="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5)}
        for name, kw in blocks.items():
            block = SparseMoeBlock(32, 16, 4, 24, moe_index=0, **kw)
            for p in block.parameters():
                torch.nn.init.normal_(p, std=0.3)
            block.experts.backend = "triton"
            x = torch.randn(T, 32)
            capture = RoutingCapture(8, 1, 4, 16, np.dtype(np.uint8))  # 8 rows, 1 MoE layer, K=4, E=16
            capture.begin_step(4)
            launches.clear()
            with set_forward_context(ForwardContext(meta, [], capture)):
                out = block(x)
            assert launches == ["_fused_routing_kernel"] and not aligns, (name, launches, aligns)
            weights, ids = block.route(x)
            capture.check_complete()  # the kernel's write counts as the layer's capture
            assert np.array_equal(capture.step_rows(4)[:, 0], ids[:4].numpy().astype(np.uint8)), name
            assert (capture.buffer[4:] == 0).all(), name  # the padded token (slot -1) wrote nothing
            ref = loop_experts(x, block.experts.w13, block.experts.w2, weights, ids)
            if block.shared_experts is not None:
                ref = ref + block.shared_experts(x)
            assert ((out - ref).norm() / ref.norm()).item() < 1e-5, name
    """)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spec": dict(top_k=17)}, r"top_k=17 is outside \[1, E=16\]"),
        ({"spec": dict(top_k=2, scoring="sigmoid")}, r"sigmoid scoring needs e_score_correction_bias \[16\]"),
        ({"buffer": (4, 2, 3)}, r"capture buffer \(4, 2, 3\) is not a \[max_tokens, L, 2\] tensor"),
        ({"buffer": (2, 2, 2)}, r"6 tokens do not fit the capture buffer \(2, 2, 2\)"),
        ({"slots": 5}, r"slot_mapping \(5,\) is not \[6\]"),
    ],
)
def test_arguments_the_kernel_cannot_serve_are_refused_by_name(kwargs: dict, match: str) -> None:
    pytest.importorskip("triton")
    from fastdeploy_r3.model_executor.ops.fused_routing import RouterSpec, fused_routing

    spec = RouterSpec(**kwargs.get("spec", dict(top_k=2)))
    buffer = torch.zeros(*kwargs["buffer"], dtype=torch.int32) if "buffer" in kwargs else None
    slots = torch.zeros(kwargs["slots"], dtype=torch.int64) if "slots" in kwargs else None
    with pytest.raises(ValueError, match=match):
        fused_routing(torch.zeros(6, 16), spec, None, buffer, moe_index=1, slot_mapping=slots)


def test_router_spec_refuses_unknown_scoring_and_impossible_groups() -> None:
    from fastdeploy_r3.model_executor.ops.fused_routing import RouterSpec

    with pytest.raises(ValueError, match="scoring 'tanh'"):
        RouterSpec(2, "tanh")
    with pytest.raises(ValueError, match=r"topk_group=3 must be in \[1, n_group=2\]"):
        RouterSpec(2, "sigmoid", n_group=2, topk_group=3)
