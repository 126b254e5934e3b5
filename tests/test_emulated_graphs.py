"""The lean engine's CUDA-graph path on the CPU, through tests/emulated_graphs.py: every graph body (the static
steps, the heads' ops) captured and replayed with a CUDA graph's semantics, so that what a graph bakes in and
what it refuses show up here, without a GPU: greedy Medusa still equals transformers' generate, replayed steps
and heads equal their eager runs on new inputs. tests/test_cuda.py runs the real graphs on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.decoding.drafter import GraphedDrafter, row
from treesearch.tree import load_tree

from .conftest import hf_greedy, random_heads, tiny_llama
from .emulated_graphs import CaptureError, EmulatedGraph, emulated_capture
from .graph_checks import check_graphed_heads, check_graphed_steps


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The lean engine replays its steps and heads from (emulated) graphs on the CPU, as it does on CUDA."""
    from medusa_runtime.engines import graphs
    from medusa_runtime.engines import lean as engine

    captured: list[EmulatedGraph] = []

    def capture(body, device):
        graph, out = emulated_capture(body, device)
        captured.append(graph)
        return graph, out

    monkeypatch.setattr(engine, "graphs_enabled", lambda device: True)
    monkeypatch.setattr(graphs, "capture", capture)
    return captured


def test_the_emulation_replays_tensors_and_bakes_python_values():
    x, scale = torch.arange(4.0), 2.0
    graph, out = emulated_capture(lambda: x * scale + x.sum(), torch.device("cpu"))
    x.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    scale = 10.0  # noqa: F841 -- a Python value: the graph keeps the one it was captured with
    graph.replay()
    assert out.tolist() == [3.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("body", [
    lambda t: t[torch.tensor(2)],  # a 0-d tensor index is read on the host (.item())
    lambda t: t[t > 3],  # a boolean mask's size is read on the host
    lambda t: t * float(t.max()),
])
@pytest.mark.parametrize("inference", [False, True])
def test_the_emulation_refuses_host_reads_as_capture_does(body, inference):
    with torch.inference_mode(inference):
        t = torch.arange(6.0)
        with pytest.raises(CaptureError, match="host"):
            emulated_capture(lambda: body(t), torch.device("cpu"))


def test_a_root_in_a_tensor_is_read_on_the_device():
    table, root = torch.randn(6, 3), torch.tensor(2)
    graph, out = emulated_capture(lambda: row(table, root) * 1.0, torch.device("cpu"))
    root.fill_(5)
    graph.replay()
    assert torch.equal(out, table[5]) and torch.equal(row(table, 4), table[4])


@pytest.mark.parametrize("condition", ["none", "root", "path"])
@pytest.mark.parametrize("tree", ["chain:3", "mc_sim_7b_63"])
def test_graphed_greedy_medusa_is_generate(graphs_on_cpu, condition, tree):
    loaded = tiny_llama()
    rng = random.Random(9)
    heads = random_heads(loaded, condition, seed=4, num_heads=5)
    dec = MedusaDecoder(loaded, heads, load_tree(tree), config=DecodeConfig(max_new_tokens=40, topk=10))
    assert dec.engine.graphs and isinstance(dec.drafter, GraphedDrafter)
    for n in (7, 19):  # a second prompt on the same pooled storage replays the first one's graphs
        prompt = [rng.randrange(loaded.vocab_size) for _ in range(n)]
        res = dec.generate(prompt)
        assert res.token_ids == hf_greedy(loaded, prompt, 40)
        assert max(res.stats.accept_lengths) > 1  # candidates were accepted beyond the root
    assert len(graphs_on_cpu) == 2 and all(g.replays > 10 for g in graphs_on_cpu)  # the step's and the heads'


def test_graphed_steps_equal_eager_static_steps(graphs_on_cpu):
    check_graphed_steps(tiny_llama(), atol=2e-5, rtol=1e-5)
    assert len(graphs_on_cpu) == 1 and graphs_on_cpu[0].replays == 5


@pytest.mark.parametrize("condition", ["none", "root", "path"])
def test_graphed_heads_equal_their_eager_ops(graphs_on_cpu, condition):
    check_graphed_heads(tiny_llama(), condition)
    assert graphs_on_cpu[-1].replays == 4


@pytest.mark.parametrize("rule", ["greedy", "typical", "sample"])
@pytest.mark.parametrize("gate,lookup", [(0.0, 0), (0.2, 0), (0.0, 3)])
def test_graphed_decoding_equals_eager_static_decoding(graphs_on_cpu, rule, gate, lookup):
    """Every acceptance rule, the confidence gate (eager heads, graphed steps) and a lookup chain beside the heads:
    the same tokens, seed for seed, as the same fixed-shape steps run eagerly."""
    from medusa_runtime.decoding.acceptance import AcceptConfig
    from treesearch.ngram import LookupConfig

    loaded = tiny_llama()
    heads = random_heads(loaded, "path", seed=6, num_heads=4)
    accept = AcceptConfig(rule, temperature=0.0 if rule == "greedy" else 0.8)
    look = LookupConfig(num_tokens=lookup, min_ngram=1)
    runs = []
    for engine in ("lean", "lean-static"):
        dec = MedusaDecoder(loaded, heads, load_tree("mc_sim_7b_63"), accept, DecodeConfig(
            max_new_tokens=48, topk=10, seed=3, engine=engine, gate=gate, lookup=look))
        prompt = [5, 9, 11, 5, 9, 11, 5, 9]
        runs.append((dec.generate(prompt).token_ids, dec.generate(prompt[::-1]).token_ids))
    assert runs[0] == runs[1]
    assert graphs_on_cpu and all(g.replays > 0 for g in graphs_on_cpu)
