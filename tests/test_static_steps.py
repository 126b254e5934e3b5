"""The fixed-shape decode steps that CUDA graphs capture (medusa_runtime/engines/graphs.py), run eagerly on the CPU
(engine ``lean-static``): their rows against sequential forwards with stale values in the unwritten slots,
greedy decoding against transformers' generate, and the pool that lets a later generate replay the steps (and
graphs) of an earlier one. tests/test_cuda.py runs the captured graphs themselves."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.engines import make_engine
from medusa_runtime.engines.base import EngineError
from medusa_runtime.engines.graphs import MIN_CAPACITY, bucket
from medusa_runtime.engines.lean import LeanEngine
from medusa_runtime.heads.medusa import fresh_heads

from .conftest import OracleHeads, hf_greedy, random_heads, tiny_llama
from .test_tree import random_tree


def test_bucket_is_the_next_power_of_two():
    assert [bucket(c) for c in (1, 256, 257, 600, 1024, 1025)] == [MIN_CAPACITY, 256, 512, 1024, 1024, 2048]


@pytest.mark.parametrize("seed", range(3))
def test_static_tree_rows_equal_sequential_forwards_over_stale_slots(seed):
    """A step attends over the whole cache: what earlier (longer) runs left beyond its rows must stay hidden."""
    loaded = tiny_llama()
    rng = random.Random(seed)
    tree = random_tree(rng, 24, 4, 3)
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(rng.randint(5, 40))]
    heads = fresh_heads(tree.depth, 1, loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(topk=tree.max_rank + 1, engine="lean-static"))
    tokens = torch.tensor([rng.randrange(loaded.vocab_size) for _ in range(tree.num_nodes)])
    cache = dec.new_cache(len(prompt) + tree.num_nodes)
    assert cache.capacity == bucket(len(prompt) + tree.num_nodes)
    with torch.no_grad():
        cache.keys.normal_(0, 30)  # stale, large: any leak into a row's attention would move its logits
        cache.values.normal_(0, 30)
        dec.prefill(torch.tensor(prompt), cache)
        step = dec.engine.decode_step(tokens, len(prompt), cache, dec.buffers.attn_mask, dec.buffers.position_offsets)
        paths = [()] + list(tree.paths)
        for i, path in enumerate(paths):
            nodes = sorted((j for j in range(len(paths)) if path[: len(paths[j])] == paths[j]), key=lambda j: len(paths[j]))
            out = loaded.model(torch.tensor([prompt + tokens[nodes].tolist()]), output_hidden_states=True)
            want = out.logits[0, -1].float()
            torch.testing.assert_close(step.logits[i], want, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(step.hidden[i], out.hidden_states[-1][0, -1], atol=2e-4, rtol=1e-4)
            assert step.pred[i] == int(want.argmax())


@pytest.mark.parametrize("seed", range(3))
def test_static_greedy_with_oracle_heads_equals_generate(seed):
    """Long accepted paths (cache compaction in a pooled cache), then a shorter prompt on the same storage."""
    loaded = tiny_llama()
    rng = random.Random(40 + seed)
    for n in (60, 20):
        prompt = [rng.randrange(loaded.vocab_size) for _ in range(rng.randint(3, 12))]
        ref = hf_greedy(loaded, prompt, n)
        tree = random_tree(rng, rng.randint(4, 30), max_depth=4, max_rank=3)
        oracle = OracleHeads(loaded, prompt + ref, num_heads=4, topk=8, max_rank=3, miss=0.15, seed=seed)
        res = MedusaDecoder(loaded, oracle, tree, config=DecodeConfig(max_new_tokens=n, topk=8,
                                                                      engine="lean-static")).generate(prompt)
        assert res.token_ids == ref
        assert max(res.stats.accept_lengths) >= 2


def test_pooled_caches_keep_their_steps_and_are_not_shared_while_held():
    loaded = tiny_llama()
    heads = fresh_heads(3, 1, loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, "chain:3", config=DecodeConfig(max_new_tokens=12, engine="lean-static"))
    plain = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=12, engine="lean-static"))
    prompt = [3, 1, 4, 1, 5]
    first = dec.generate(prompt).token_ids
    assert plain.generate(prompt).token_ids == first  # another engine, the same pooled storage
    held = dec.new_cache(40)  # the storage both generates used, free again
    storage, steps = held.storage, dict(held.storage.steps)
    assert len(steps) == 2  # chain:3's layout and plain decoding's one row
    other = dec.new_cache(40)  # asked for while `held` lives: a storage of its own
    assert other.storage is not storage and other.storage.free is False
    del held
    gc.collect()
    assert dec.generate(prompt).token_ids == first  # on the freed storage, its step replayed, none added
    reused = dec.new_cache(40)
    assert reused.storage is storage and reused.storage.steps.keys() == steps.keys()
    assert all(reused.storage.steps[k] is v for k, v in steps.items())
    del reused, other, dec
    gc.collect()
    again = MedusaDecoder(loaded, heads, "chain:3", config=DecodeConfig(max_new_tokens=12, engine="lean-static"))
    assert again.generate(prompt).token_ids == first  # a new decoder, its own mask tensor, the same layout
    assert storage.steps.keys() == steps.keys() and all(storage.steps[k] is v for k, v in steps.items())
    chain2 = MedusaDecoder(loaded, heads, "chain:2", config=DecodeConfig(max_new_tokens=12, engine="lean-static"))
    chain2.generate(prompt)
    took = chain2.new_cache(40).storage  # the storage that generate took (an engine's own last one comes first)
    assert 3 in {step.rows.shape[0] for step in took.steps.values()}  # another layout (root + 2): a step of its own


def test_an_engine_gets_back_the_storage_it_took_last():
    """Runs in lockstep hold a cache each: each engine's next cache is its own last storage, where its graphs are."""
    loaded = tiny_llama()
    decs = [MedusaDecoder(loaded, fresh_heads(3, 1, loaded.hidden_size, loaded.vocab_size), tree,
                          config=DecodeConfig(engine="lean-static")) for tree in ("chain:2", "chain:3")]
    held = [d.new_cache(40) for d in decs]
    storages = [c.storage for c in held]
    assert storages[0] is not storages[1]
    del held
    gc.collect()
    assert decs[1].new_cache(40).storage is storages[1]  # though the first free one in the pool is the other
    assert decs[0].new_cache(40).storage is storages[0]


def test_static_steps_refuse_what_they_cannot_run():
    loaded = tiny_llama()
    engine = make_engine(loaded, "lean-static", max_nodes=4)
    assert engine.static and engine.fused_steps and not engine.graphs  # graphs on CUDA only
    eager = make_engine(loaded, "lean-torch", max_nodes=4)
    with pytest.raises(EngineError, match="new_cache"):
        engine.decode_step(torch.tensor([1]), 0, eager.new_cache(8))
    cache = engine.new_cache(8)
    with pytest.raises(EngineError, match="cannot take"):
        engine.decode_step(torch.tensor([1, 2]), cache.capacity - 1, cache, torch.ones(2, 2, dtype=torch.bool),
                           torch.zeros(2, dtype=torch.long))
    with pytest.raises(EngineError, match="tree mask"):
        engine.decode_step(torch.tensor([1, 2]), 0, cache)
    with pytest.raises(EngineError, match="exclude"):
        LeanEngine(loaded, use_kernels=True, static_steps=True)


@pytest.mark.parametrize("condition", ["none", "root", "path"])
def test_drafters_take_the_root_as_a_tensor_as_their_graph_does(condition):
    """GraphedDrafter replays the drafter's ops with the root token in a 0-d tensor: the same candidates as with
    the int the decode loop passes (CUDA runs the capture itself, tests/test_cuda.py)."""
    from medusa_runtime.decoding.drafter import make_drafter

    loaded = tiny_llama()
    heads = random_heads(loaded, condition, seed=3)
    engine = make_engine(loaded, "lean-torch", max_nodes=20)
    tree = random_tree(random.Random(1), 20, 3, 3)
    drafter = make_drafter(heads, loaded.model, engine, tree, 4, loaded.device)
    hidden = torch.randn(loaded.hidden_size)
    seen = []
    for root in (0, 17, 63):
        if drafter.in_node_order:
            want, _ = drafter.nodes_torch(hidden, root, 0.0)
            got, _ = drafter.nodes_torch(hidden, torch.tensor(root), 0.0)
            assert want[0] == root
        else:
            want, got = drafter.top(hidden, root)[0], drafter.top(hidden, torch.tensor(root))[0]
        assert torch.equal(got, want)
        seen.append(want.flatten()[1:].tolist())
    assert (seen[0] != seen[2]) == (condition != "none")  # the root is read where the heads are conditioned


def test_every_command_offers_every_engine():
    from bench.cli_reference import all_parsers
    from medusa_runtime.engines.base import ENGINES

    offered = {name: action.choices for name, parser in all_parsers().items() for action in parser._actions
               if "--engine" in action.option_strings}
    assert offered and all(list(choices) == list(ENGINES) for choices in offered.values()), offered
