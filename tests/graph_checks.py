"""Checks of the lean engine's graph path shared by tests/test_cuda.py (real CUDA graphs on a GPU) and
tests/test_emulated_graphs.py (emulated graphs on the CPU): the same comparisons, on either device."""

from __future__ import annotations

import random

import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.decoding.drafter import GraphedDrafter
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.model import LoadedModel

from .conftest import random_heads
from .test_tree import random_tree


def check_graphed_steps(loaded: LoadedModel, atol: float, rtol: float) -> None:
    """Five tree steps replayed from graphs (engine lean) against the same fixed-shape steps run eagerly
    (lean-static), each on new tokens and with compaction between them: equal logits and argmax, and logits that
    change from step to step (a replay that read stale inputs would repeat the last step's values)."""
    rng = random.Random(2)
    tree = random_tree(rng, 20, 4, 3)
    heads = fresh_heads(tree.depth, 1, loaded.hidden_size, loaded.vocab_size)
    decs = [MedusaDecoder(loaded, heads, tree, config=DecodeConfig(topk=tree.max_rank + 1, engine=e))
            for e in ("lean", "lean-static")]
    assert decs[0].engine.graphs and decs[1].engine.static and not decs[1].engine.graphs
    prompt = torch.tensor([rng.randrange(loaded.vocab_size) for _ in range(30)], device=loaded.device)
    caches = [d.new_cache(200) for d in decs]
    with torch.inference_mode():
        for d, c in zip(decs, caches):
            d.prefill(prompt, c)
        start, last = 30, None
        for _ in range(5):
            tokens = torch.randint(0, loaded.vocab_size, (tree.num_nodes,), device=loaded.device)
            got, want = (d.engine.decode_step(tokens, start, c, d.buffers.attn_mask, d.buffers.position_offsets)
                         for d, c in zip(decs, caches))
            torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=rtol)
            assert got.pred == want.pred
            assert last is None or not torch.equal(got.logits, last)
            last = got.logits.clone()
            path = [0, *decs[0].buffers.children[0][:1]]
            for d, c in zip(decs, caches):
                d.compact(c, start, path)
            start += len(path)


def check_graphed_heads(loaded: LoadedModel, condition: str) -> None:
    """Heads of ``condition`` replayed from graphs against their eager ops, for four roots and hidden states:
    the same tokens, and tokens that change with the inputs."""
    heads = random_heads(loaded, condition, seed=4)
    tree = random_tree(random.Random(1), 20, 3, 3)
    dec = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(topk=4))
    assert isinstance(dec.drafter, GraphedDrafter)
    seen = []
    with torch.inference_mode():
        for root in (0, 17, 63, 5):
            hidden = torch.randn(loaded.hidden_size, device=loaded.device)
            if dec.drafter.in_node_order:
                got, _ = dec.drafter.nodes(hidden, root, 0.0)
                want, _ = dec.drafter.inner.nodes_torch(hidden, root, 0.0)
            else:
                got, want = dec.drafter.top(hidden, root)[0], dec.drafter.inner.top(hidden, root)[0]
            assert torch.equal(got, want)
            seen.append(got.clone())
    assert not torch.equal(seen[0], seen[1])
