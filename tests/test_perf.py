"""Microbenchmarks of the hot pieces of a decode step (pytest-benchmark).

In the default test session timing is disabled (``--benchmark-disable``): each benchmark runs once
and its assertions check the result. ``nox -s perf`` runs them timed.
"""

from __future__ import annotations

import pytest
import torch

from medusa_runtime import kernels
from medusa_runtime.decoding.acceptance import accept_greedy
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.engines.lean import LeanEngine
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.model import load_model
from medusa_runtime.tree.buffers import build_tree_buffers
from medusa_runtime.tree.lookup import with_lookup_chain
from treesearch.tree import load_tree, make_tree

from .conftest import tiny_llama


@pytest.fixture(scope="module")
def bf16_default():
    return load_model("default", "bfloat16", log=lambda m: None)


def test_bench_build_buffers(benchmark):
    tree = load_tree("mc_sim_7b_63")

    def build():
        return with_lookup_chain(build_tree_buffers(tree, 5, 10), 6, tree.depth)

    buffers = benchmark(build)
    assert buffers.num_nodes == 64 + 6
    assert bool(buffers.attn_mask.diagonal().all())


def test_bench_propose(benchmark):
    """Heads (batched per level) + top-k + gather into the tree's N tokens."""
    loaded = tiny_llama(vocab=512)
    heads = fresh_heads(5, 1, loaded.hidden_size, loaded.vocab_size)
    with torch.no_grad():
        for blocks in heads.blocks:
            blocks[0].linear.weight.normal_(0, 0.1)
    dec = MedusaDecoder(loaded, heads, "mc_sim_7b_63")
    hidden = torch.randn(loaded.hidden_size)
    tokens = benchmark(dec.propose, hidden, 7)
    # reference: the module path (one head at a time) and the tree's candidate slots
    logits = heads(hidden, loaded.model.get_output_embeddings())
    top = torch.topk(logits[: dec.tree.depth], 10, dim=-1).indices.flatten()
    flat = torch.cat([torch.tensor([7]), top])
    assert torch.equal(tokens, flat[dec.buffers.candidate_index])


def test_bench_accept_greedy(benchmark):
    tree = load_tree("mc_sim_7b_63")
    buffers = build_tree_buffers(tree, 5, 10)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(buffers.num_nodes, 49152, generator=gen)
    tokens = torch.randint(0, 49152, (buffers.num_nodes,), generator=gen)
    # make the path root -> (0,) -> (0, 0) correct
    first, second = 1, int(buffers.children[1][0])
    tokens[first], tokens[second] = int(logits[0].argmax()), int(logits[first].argmax())
    acc = benchmark(accept_greedy, tokens, logits, buffers)
    assert acc.path[:3] == [0, first, second] and acc.next_token == int(logits[acc.path[-1]].argmax())


@pytest.mark.parametrize("kernels", [True, False], ids=["c", "torch"])
def test_bench_compact(benchmark, bf16_default, kernels):
    """Accepted nodes' keys/values moved into place for all layers at once (one C call where the C forward
    runs, else an index_select), against the rows copied before."""
    engine = LeanEngine(bf16_default, max_nodes=64, use_kernels=kernels)
    assert (engine.lib is not None) == kernels  # the path under test
    cache = engine.new_cache(600)
    cache.keys.normal_()
    cache.values.normal_()
    path = [0, 3, 17, 40]
    rows = [512 + p for p in path]
    want_k, want_v = cache.keys[:, :, rows].clone(), cache.values[:, :, rows].clone()
    past = cache.keys[:, :, :512].clone()
    engine.compact(cache, 512, path)  # the checked call
    assert torch.equal(cache.keys[:, :, 512:516], want_k) and torch.equal(cache.values[:, :, 512:516], want_v)
    assert torch.equal(cache.keys[:, :, :512], past)
    benchmark(engine.compact, cache, 512, path)  # timing: the same gather again


ENGINES = {"lean": ("lean", "1"), "lean-avx512": ("lean", "0"), "lean-torch": ("lean-torch", "1")}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("nodes", [1, 2, 4, 8, 16])
def test_bench_verify_default_bf16(benchmark, bf16_default, nodes, engine, monkeypatch):
    """One lean verify forward of the default model in bf16 at context 256: the C forward (on AMX tiles where
    the CPU has them), the C forward held to its AVX-512 path, and the PyTorch path."""
    name, amx = ENGINES[engine]
    monkeypatch.setenv(kernels.AMX_SWITCH, amx)
    heads = fresh_heads(5, 1, bf16_default.hidden_size, bf16_default.vocab_size)
    tree = make_tree(load_tree("mc_sim_7b_63").paths[: nodes - 1]) if nodes > 1 else None
    dec = MedusaDecoder(bf16_default, heads if tree else None, tree, config=DecodeConfig(topk=10, engine=name))
    assert dec.engine.name == "lean" and dec.engine.uses_kernels is (name == "lean" and kernels.fast_path())
    assert dec.engine.lib is None or dec.engine.amx == (amx == "1" and kernels.amx_path())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, bf16_default.vocab_size, (256,), generator=gen)
    cache = dec.new_cache(256 + nodes)
    dec.prefill(prompt, cache)
    tokens = torch.randint(0, bf16_default.vocab_size, (nodes,), generator=gen)
    logits, hidden = benchmark(dec.verify, tokens, 256, cache)
    assert logits.shape == (nodes, bf16_default.vocab_size) and hidden.shape == (nodes, bf16_default.hidden_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("heads_path", ["native", "pytorch"])
@pytest.mark.parametrize("tree", ["chain:1", "chain:2", "mc_sim_7b_63"])
def test_bench_propose_shipped_heads(benchmark, bf16_default, tree, heads_path):
    """The shipped (path-conditioned) heads proposing a tree's tokens, level by level: in the C library where the
    C forward runs (native), or PyTorch's ops; checked against the PyTorch path's proposal on the same state."""
    from medusa_runtime.heads.medusa import resolve_heads

    heads = resolve_heads("default", bf16_default.hidden_size, bf16_default.vocab_size)
    native = MedusaDecoder(bf16_default, heads, tree, config=DecodeConfig(native_heads=heads_path == "native"))
    torch_path = MedusaDecoder(bf16_default, heads, tree, config=DecodeConfig(native_heads=False))
    prompt = torch.randint(0, bf16_default.vocab_size, (32,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # a real last hidden state, as the decoder gives the heads
        hidden = native.prefill(prompt, native.new_cache(40))[1][-1]
    tokens = benchmark(native.propose, hidden, 1234)
    want = torch_path.propose(hidden, 1234)
    assert tokens.shape == want.shape and int(tokens[0]) == 1234
    # level 1 (head 0 on the root): the same candidates up to near-ties of bf16 logits (deeper levels read their
    # parents, so one near-tie above moves a whole subtree)
    first = torch.tensor([i + 1 for i, p in enumerate(native.tree.paths) if len(p) == 1])
    assert len(set(tokens[first].tolist()) & set(want[first].tolist())) >= 0.8 * len(first)
