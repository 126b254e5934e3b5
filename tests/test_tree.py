"""Trees as data: validation, official order, presets, JSON round trip; buffers against brute force."""

from __future__ import annotations

import json
import random

import pytest
import torch

from medusa_runtime.tree.buffers import build_tree_buffers
from treesearch.tree import (
    TREE_SCHEMA,
    Tree,
    TreeError,
    chain,
    check_fits,
    load_tree,
    make_tree,
    official_order,
    save_tree,
    tree_from_json,
)

from .conftest import DATA


def random_tree(rng: random.Random, n: int, max_depth: int, max_rank: int) -> Tree:
    """A random valid tree: grow by attaching a new child under a random existing node."""
    paths: set[tuple[int, ...]] = set()
    frontier: list[tuple[int, ...]] = [()]
    while len(paths) < n:
        parent = rng.choice(frontier)
        if len(parent) >= max_depth:
            continue
        child = parent + (rng.randrange(max_rank + 1),)
        if child not in paths:
            paths.add(child)
            frontier.append(child)
    return make_tree([list(p) for p in paths], name="random")


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "empty"),
        ([[0], [1, 0], [1, 0]], "duplicate"),
        ([[0], [0, 0, 1]], "no parent"),
        ([[0], [1, 2]], "no parent"),
        ([[0], [-1]], ">= 0"),
        ([[0], []], "non-empty"),
        ([[0], [0.5]], "integers"),
        ("[[0]]", "list of rank paths"),
    ],
)
def test_validation_errors(paths, message):
    with pytest.raises(TreeError, match=message):
        make_tree(paths)


def test_official_order_and_properties():
    tree = make_tree([[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (tree.num_nodes, tree.depth, tree.max_rank) == (7, 3, 1)


def test_official_presets_match_reference_data():
    reference = json.loads((DATA / "medusa" / "medusa_choices.json").read_text())
    for name, paths in reference.items():
        tree = load_tree(name)
        assert tree.num_nodes == len(paths) + 1 == 64
        assert tree.paths == official_order(paths)
    # the official code sorts the listed paths by (length, ranks) before use; so do we
    assert [list(p) for p in load_tree("mc_sim_7b_63").paths] == sorted(reference["mc_sim_7b_63"],
                                                                       key=lambda p: (len(p), p))


def test_chain_and_unknown_names():
    assert chain(3).paths == ((0,), (0, 0), (0, 0, 0))
    assert load_tree("chain:2").name == "chain:2"
    with pytest.raises(TreeError, match="unknown tree"):
        load_tree("no_such_tree")
    with pytest.raises(TreeError, match="chain"):
        load_tree("chain:x")
    with pytest.raises(TreeError, match="depth >= 1"):
        chain(0)


def test_json_roundtrip_and_bad_files(tmp_path):
    tree = load_tree("mc_sim_7b_63")
    path = save_tree(tree, tmp_path / "t.json", predicted_tau=2.34)
    obj = json.loads(path.read_text())
    assert obj["schema"] == TREE_SCHEMA and obj["predicted_tau"] == 2.34
    again = load_tree(str(path))
    assert again.paths == tree.paths and again.meta["predicted_tau"] == 2.34
    assert tree_from_json([[0], [0, 0]]).num_nodes == 3

    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TreeError, match="not valid JSON"):
        load_tree(str(tmp_path / "bad.json"))
    (tmp_path / "schema.json").write_text(json.dumps({"schema": "other/9", "medusa_choices": [[0]]}))
    with pytest.raises(TreeError, match="schema"):
        load_tree(str(tmp_path / "schema.json"))
    with pytest.raises(TreeError, match="not found"):
        load_tree(str(tmp_path / "missing.json"))


def test_check_fits():
    tree = load_tree("mc_sim_7b_63")  # depth 4, ranks up to 9
    check_fits(tree, num_heads=4, topk=10)
    with pytest.raises(TreeError, match="4 levels deep but only 3 Medusa heads"):
        check_fits(tree, num_heads=3, topk=10)
    with pytest.raises(TreeError, match="rank 9"):
        check_fits(tree, num_heads=5, topk=5)


@pytest.mark.parametrize("seed", range(6))
def test_buffers_against_brute_force(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, n=rng.randint(1, 40), max_depth=4, max_rank=5)
    topk = 6
    buf = build_tree_buffers(tree, num_heads=4, topk=topk)
    paths = [()] + list(tree.paths)
    n = len(paths)
    assert buf.num_nodes == n and buf.depth == tree.depth
    for i, p in enumerate(paths):
        for j, q in enumerate(paths):
            # j is visible from i exactly when q is a prefix of p
            assert bool(buf.attn_mask[i, j]) == (p[: len(q)] == q), (p, q)
        assert int(buf.position_offsets[i]) == len(p)
        if p:
            assert int(buf.candidate_index[i]) == 1 + (len(p) - 1) * topk + p[-1]
            assert paths[int(buf.parent[i])] == p[:-1]
            assert i in buf.children[int(buf.parent[i])]
    # retrieve rows: exactly the root-to-leaf paths
    leaves = {p for p in paths if not any(q[:-1] == p for q in paths if q)}
    rows = set()
    for row in buf.retrieve_indices.tolist():
        nodes = [r for r in row if r >= 0]
        assert nodes[0] == 0
        rows.add(paths[nodes[-1]])
        for a, b in zip(nodes, nodes[1:]):
            assert paths[b][:-1] == paths[a]
    assert rows == leaves


def test_buffers_are_pure():
    tree = load_tree("vicuna_7b_stage2")
    a, b = build_tree_buffers(tree, 5, 10), build_tree_buffers(tree, 5, 10)
    for name in ("attn_mask", "position_offsets", "candidate_index", "retrieve_indices", "parent"):
        assert torch.equal(getattr(a, name), getattr(b, name))
