"""Our models against `transformers` on the same fake tiny checkpoint, float32 on CPU.

Top-k expert ids are compared per token as SORTED id lists (the order inside a top-k is not
meaningful: HF's GLM router uses topk(sorted=False)), and must be equal exactly.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.config.hf_config import moe_layer_ids_from_hf_config
from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.model_loader import load_model

transformers = pytest.importorskip("transformers")

ARCHS = ["qwen3_moe", "mixtral", "glm4_moe"]
PROMPT_A = "Hello world! Tell me a story about the experts, 1234 ü 日本."
PROMPT_B = "def main():\n    return 42"


class _Pair:
    def __init__(self, model_dir: str) -> None:
        mc = ModelConfig(model=model_dir, dtype="float32").finalize()
        self.ours = load_model(mc, torch.device("cpu"))
        self.moe_layer_ids = mc.moe_layer_ids
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        assert moe_layer_ids_from_hf_config(mc.hf_config) == self.ours.moe_layer_ids

    def ids(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.int64)

    @torch.no_grad()
    def hf_logits_and_topk(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """HF logits [T, V] and, per MoE layer, the router's top-k ids [T, K] taken by forward hooks."""
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for name, module in self.hf.named_modules():
            # transformers v5: <Family>TopKRouter at model.layers.{i}.mlp.gate returns (logits, weights, ids)
            if name.endswith(".mlp.gate") and type(module).__name__.lower().endswith("topkrouter"):
                layer = int(name.split(".")[2])
                handles.append(module.register_forward_hook(lambda m, a, out, i=layer: captured.__setitem__(i, out[2])))
        try:
            logits = self.hf(ids[None]).logits[0].float()
        finally:
            for h in handles:
                h.remove()
        assert sorted(captured) == self.moe_layer_ids, "HF MoE layers differ from moe_layer_ids_from_hf_config"
        return logits, [captured[i] for i in self.moe_layer_ids]

    @torch.no_grad()
    def our_logits(self, ids: torch.Tensor, sink: object | None = None) -> torch.Tensor:
        with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[], routing_capture=sink)):
            return self.ours.compute_logits(self.ours(ids, torch.arange(len(ids))))


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, fake_model_dir) -> _Pair:
    return _Pair(fake_model_dir(request.param))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _assert_same_topk(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for layer, (a, b) in enumerate(zip(ours, ref, strict=True)):
        a, b = a.sort(dim=-1).values.long(), b.sort(dim=-1).values.long()
        bad = (a != b).any(dim=-1).nonzero().flatten().tolist()
        assert not bad, f"MoE layer {layer}: top-k differs for tokens {bad}: ours {a[bad].tolist()} " \
            f"HF {b[bad].tolist()}"


def test_logits_and_router_topk_match_hf(pair: _Pair, new_routing_sink) -> None:
    """One prompt without a KV cache: logits within 1e-4, every layer's top-k ids identical."""
    ids = pair.ids(PROMPT_A)
    ref_logits, ref_topk = pair.hf_logits_and_topk(ids)
    sink = new_routing_sink()
    logits = pair.our_logits(ids, sink)
    assert _rel_err(logits, ref_logits) < 1e-4
    assert [i for i, _ in sink.calls] == list(range(len(pair.moe_layer_ids)))
    ours_topk = sink.per_layer(len(pair.moe_layer_ids))
    assert all(t.shape == (len(ids), pair.ours.top_k) for t in ours_topk)
    _assert_same_topk(ours_topk, ref_topk)


def test_paged_chunked_prefill_matches_hf(pair: _Pair, new_routing_sink) -> None:
    """Block size 4, scattered block tables; step 1 = A's first chunk + all of B, step 2 = A's rest +
    one decode token of B. Every token's logits and top-k must equal HF run on the whole sequence."""
    a, b = pair.ids(PROMPT_A), pair.ids(PROMPT_B)
    b_next = torch.tensor([7])
    block_size, num_blocks = 4, 32
    tables = {"a": [9, 3, 17, 5, 20, 11, 2, 30, 14, 6, 25, 1], "b": [8, 0, 22, 13, 27, 4, 19]}
    assert len(a) <= len(tables["a"]) * block_size and len(b) + 1 <= len(tables["b"]) * block_size
    shape = (num_blocks, block_size, pair.ours.num_kv_heads, pair.ours.head_dim)
    kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(pair.ours.num_layers)]
    block_tables = torch.tensor([tables["a"], tables["b"] + [0] * (len(tables["a"]) - len(tables["b"]))])
    split = len(a) // 2

    def step(chunks: list[tuple[int, torch.Tensor, int]], sink) -> torch.Tensor:
        """chunks: (request row, new token ids, number of tokens already in the cache)."""
        ids, positions, slots, starts, qlens, slens = [], [], [], [0], [], []
        for row, new, computed in chunks:
            pos = torch.arange(computed, computed + len(new))
            ids.append(new)
            positions.append(pos)
            slots.append(block_tables[row, pos // block_size] * block_size + pos % block_size)
            qlens.append(len(new))
            slens.append(computed + len(new))
            starts.append(starts[-1] + len(new))
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots), query_start_loc=starts, query_lens=qlens, seq_lens=slens,
            block_tables=block_tables, block_size=block_size,
        )
        with torch.no_grad(), set_forward_context(ForwardContext(meta, kv_caches, sink)):
            return pair.ours.compute_logits(pair.ours(torch.cat(ids), torch.cat(positions)))

    sink1, sink2 = new_routing_sink(), new_routing_sink()
    out1 = step([(0, a[:split], 0), (1, b, 0)], sink1)
    out2 = step([(0, a[split:], split), (1, b_next, len(b))], sink2)

    num_moe = len(pair.moe_layer_ids)
    topk1, topk2 = sink1.per_layer(num_moe), sink2.per_layer(num_moe)
    ref_a, ref_a_topk = pair.hf_logits_and_topk(a)
    ref_b, ref_b_topk = pair.hf_logits_and_topk(torch.cat([b, b_next]))
    ours_a = torch.cat([out1[:split], out2[: len(a) - split]])
    ours_b = torch.cat([out1[split:], out2[len(a) - split :]])
    assert _rel_err(ours_a, ref_a) < 1e-4
    assert _rel_err(ours_b, ref_b) < 1e-4
    _assert_same_topk([torch.cat([t1[:split], t2[: len(a) - split]]) for t1, t2 in zip(topk1, topk2)], ref_a_topk)
    _assert_same_topk([torch.cat([t1[split:], t2[len(a) - split :]]) for t1, t2 in zip(topk1, topk2)], ref_b_topk)


def test_greedy_generation_matches_hf(pair: _Pair) -> None:
    """8 greedy tokens, ours by repeated full forward, HF by generate(do_sample=False): identical."""
    prompt = pair.ids(PROMPT_B)
    with torch.no_grad():
        ref = pair.hf.generate(
            prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False, max_new_tokens=8,
        )[0, len(prompt) :].tolist()
    ids = prompt
    ours: list[int] = []
    for _ in range(len(ref)):
        nxt = int(pair.our_logits(ids)[-1].argmax())
        ours.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    assert ours == ref
    assert len(set(ours)) > 1, f"greedy output collapsed to one token: {ours}"
