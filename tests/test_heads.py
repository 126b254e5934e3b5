"""Medusa heads: identity at init, both checkpoint formats round-trip, mismatches refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import (
    HeadsConfig,
    HeadsError,
    Int8Projection,
    MedusaHeads,
    ResBlock,
    fresh_heads,
    load_heads,
    resolve_heads,
    save_heads,
)

from .conftest import tiny_llama


def _randomise(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads


def test_zero_initialised_blocks_are_identity():
    block = ResBlock(16)
    x = torch.randn(5, 16)
    assert torch.equal(block(x), x)
    loaded = tiny_llama()
    heads = fresh_heads(3, 2, loaded.hidden_size, loaded.vocab_size)
    h = torch.randn(4, loaded.hidden_size)
    lm_head = loaded.model.get_output_embeddings()
    out = heads(h, lm_head)  # [4, 3, V]
    for j in range(3):
        torch.testing.assert_close(out[:, j], lm_head(h), rtol=0, atol=0)


def test_official_projection_starts_as_lm_head():
    loaded = tiny_llama()
    lm_head = loaded.model.get_output_embeddings()
    heads = MedusaHeads(HeadsConfig(2, 1, loaded.hidden_size, loaded.vocab_size, shared_lm_head=False))
    heads.init_projection_from(lm_head)
    h = torch.randn(3, loaded.hidden_size)
    torch.testing.assert_close(heads(h)[:, 1], lm_head(h))


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fmt", ["shared", "official"])
def test_roundtrip_gives_identical_outputs_and_decoding(tmp_path, shared, fmt):
    loaded = tiny_llama()
    lm_head = loaded.model.get_output_embeddings()
    heads = MedusaHeads(HeadsConfig(4, 1, loaded.hidden_size, loaded.vocab_size, shared_lm_head=shared))
    heads.init_projection_from(lm_head)
    _randomise(heads, seed=1)
    if fmt == "shared" and not shared:  # own projections would be lost in the shared format
        with pytest.raises(HeadsError, match="own projections"):
            save_heads(heads, tmp_path / fmt, fmt=fmt, lm_head=lm_head)
        assert not (tmp_path / fmt).exists()
        return
    folder = save_heads(heads, tmp_path / fmt, fmt=fmt, lm_head=lm_head)
    meta = json.loads((folder / "config.json").read_text())
    assert meta["medusa_num_heads"] == 4 and meta["medusa_num_layers"] == 1
    again = load_heads(folder, loaded.hidden_size, loaded.vocab_size)
    assert again.config.shared_lm_head == (fmt == "shared")
    h = torch.randn(6, loaded.hidden_size)
    torch.testing.assert_close(again(h, lm_head), heads(h, lm_head), rtol=0, atol=0)

    prompt = [3, 14, 15, 9, 2]
    cfg = DecodeConfig(max_new_tokens=40, topk=10)
    a = MedusaDecoder(loaded, heads, "mc_sim_7b_63", config=cfg).generate(prompt)
    b = MedusaDecoder(loaded, again, "mc_sim_7b_63", config=cfg).generate(prompt)
    assert a.token_ids == b.token_ids and a.stats.accept_lengths == b.stats.accept_lengths


def test_loads_official_pt_with_module_prefix(tmp_path):
    loaded = tiny_llama()
    heads = _randomise(MedusaHeads(HeadsConfig(2, 1, loaded.hidden_size, loaded.vocab_size, False)))
    sd = {}
    for i in range(2):
        sd[f"medusa_head.{i}.0.linear.weight"] = heads.blocks[i][0].linear.weight.detach().clone()
        sd[f"medusa_head.{i}.0.linear.bias"] = heads.blocks[i][0].linear.bias.detach().clone()
        sd[f"medusa_head.{i}.1.weight"] = heads.proj[i].detach().clone()
    torch.save(sd, tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}))
    again = load_heads(tmp_path, loaded.hidden_size, loaded.vocab_size)
    h = torch.randn(3, loaded.hidden_size)
    torch.testing.assert_close(again(h), heads(h), rtol=0, atol=0)


def test_mismatched_or_broken_heads_are_refused(tmp_path):
    small = MedusaHeads(HeadsConfig(2, 1, 32, 64, shared_lm_head=False))
    save_heads(small, tmp_path / "h32", fmt="official")
    with pytest.raises(HeadsError, match="hidden size 32, the model has 64"):
        load_heads(tmp_path / "h32", hidden_size=64, vocab_size=64)
    other_vocab = MedusaHeads(HeadsConfig(2, 1, 64, 100, shared_lm_head=False))
    save_heads(other_vocab, tmp_path / "v100", fmt="official")
    with pytest.raises(HeadsError, match="vocabulary 100, the model has 64"):
        load_heads(tmp_path / "v100", hidden_size=64, vocab_size=64)
    with pytest.raises(HeadsError, match="not found"):
        load_heads(tmp_path / "missing", 64, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsError, match="no config.json"):
        load_heads(tmp_path / "empty", 64, 64)
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.raises(HeadsError, match="no head weights"):
        load_heads(tmp_path / "empty", 64, 64)
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(HeadsError, match="not a Medusa config"):
        load_heads(tmp_path / "empty", 64, 64)


def test_resolve_heads_specs():
    assert resolve_heads(None, 64, 64) is None and resolve_heads("none", 64, 64) is None
    heads = resolve_heads("fresh:3", 64, 64)
    assert heads.num_heads == 3 and heads.config.num_layers == 1 and heads.config.shared_lm_head
    assert resolve_heads("fresh:2:3", 64, 64).config.num_layers == 3
    for bad in ("fresh:", "fresh:x", "fresh:0"):
        with pytest.raises(HeadsError, match="bad heads spec"):
            resolve_heads(bad, 64, 64)


@pytest.mark.parametrize("shared", [True, False])
def test_draft_vocabulary_restricts_proposals_and_round_trips(tmp_path, shared):
    """Heads with a draft vocabulary score only those tokens (-inf elsewhere), keep it through save/load
    in both formats, and decoding with them still equals generate (verification is unchanged)."""
    from medusa_runtime.measure.calibrate import _head_topk

    from .conftest import hf_greedy

    loaded = tiny_llama()
    lm_head = loaded.model.get_output_embeddings()
    heads = MedusaHeads(HeadsConfig(4, 1, loaded.hidden_size, loaded.vocab_size, shared_lm_head=shared))
    heads.init_projection_from(lm_head)
    _randomise(heads, seed=3)
    full = heads(torch.randn(1, loaded.hidden_size), lm_head)
    vocab = [1, 5, 9, 17, 30, 31, 40, 41, 42, 50, 51, 60, 63]
    heads.set_draft_vocab(list(reversed(vocab)) + [5])  # kept sorted and unique
    assert heads.draft_vocab.tolist() == vocab
    h = torch.randn(5, loaded.hidden_size)
    out = heads(h, lm_head)  # [5, 4, V]
    heads.set_draft_vocab(None)
    reference = heads(h, lm_head)
    heads.set_draft_vocab(vocab)
    torch.testing.assert_close(out[..., vocab], reference[..., vocab], rtol=1e-6, atol=1e-6)
    outside = [t for t in range(loaded.vocab_size) if t not in vocab]
    assert torch.isinf(out[..., outside]).all() and not torch.equal(full, out[:1])

    # calibration ranks the same candidates: the top-k of the full logits masked to the vocabulary
    top = _head_topk(loaded, heads, h, 4)[0]  # [5, 4, 4]
    assert torch.equal(top, torch.topk(out, 4, dim=-1).indices)

    fmt = "shared" if shared else "official"
    again = load_heads(save_heads(heads, tmp_path / fmt, fmt=fmt, lm_head=lm_head), loaded.hidden_size,
                       loaded.vocab_size)
    assert again.draft_vocab.tolist() == vocab
    torch.testing.assert_close(again(h, lm_head), out, rtol=0, atol=0)

    prompt = [3, 14, 15, 9, 2]
    cfg = DecodeConfig(max_new_tokens=30, topk=10)
    decoder = MedusaDecoder(loaded, again, "mc_sim_7b_63", config=cfg)
    proposed = decoder.propose(torch.randn(loaded.hidden_size), root=7)
    assert set(proposed[1:].tolist()) <= set(vocab)  # every head candidate comes from the draft vocabulary
    assert decoder.generate(prompt).token_ids == hf_greedy(loaded, prompt, 30)
    whole = MedusaDecoder(loaded, again, "mc_sim_7b_63", config=DecodeConfig(max_new_tokens=30, topk=10,
                                                                              draft_vocab=False))
    assert not set(whole.propose(torch.randn(loaded.hidden_size), root=7)[1:].tolist()) <= set(vocab)


def test_bad_draft_vocabulary_is_refused(tmp_path):
    heads = fresh_heads(2, 1, 64, 64)
    with pytest.raises(HeadsError, match="within \\[0, 64\\)"):
        heads.set_draft_vocab([3, 64])
    with pytest.raises(HeadsError, match="1 or more"):
        heads.set_draft_vocab([])
    folder = save_heads(heads, tmp_path / "h")
    (folder / "draft_vocab.json").write_text('{"ids": [1, 2]}')
    with pytest.raises(HeadsError, match="not a list of token ids"):
        load_heads(folder, 64, 64)
    (folder / "draft_vocab.json").write_text("[1, 2, 99]")
    with pytest.raises(HeadsError, match="within \\[0, 64\\)"):
        load_heads(folder, 64, 64)


def test_int8_projection_is_a_config_choice_that_round_trips_and_changes_only_the_scoring(tmp_path):
    """``medusa_draft_projection: int8`` in config.json: saved and loaded; the same heads score within int8 rounding
    of their bf16 scores (the top candidates the same here); any other value is refused in one line."""
    torch.manual_seed(0)
    heads = fresh_heads(2, 1, 64, 96)
    lm = torch.randn(96, 64)
    folder = save_heads(heads, tmp_path / "h")
    assert not load_heads(folder, 64, 96).config.projection_int8
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "medusa_draft_projection": "int8"}))
    int8 = load_heads(folder, 64, 96)
    assert int8.config.projection_int8
    again = load_heads(save_heads(int8, tmp_path / "h2"), 64, 96)
    assert again.config.projection_int8
    states = torch.randn(5, 2, 64)
    exact, approx = heads.draft_logits(states, lm), int8.draft_logits(states, lm)
    assert torch.equal(approx, Int8Projection(lm)(states)) and not torch.equal(approx, exact)
    assert (approx - exact).abs().max() <= 0.02 * exact.abs().max()  # logits of magnitude ~20: within 0.4
    assert torch.equal(approx.argmax(-1), exact.argmax(-1))
    (folder / "config.json").write_text(json.dumps({**cfg, "medusa_draft_projection": "fp8"}))
    with pytest.raises(HeadsError, match="must be 'bf16' or 'int8'"):
        load_heads(folder, 64, 96)


def test_root_conditioned_heads_read_the_root_and_round_trip(tmp_path):
    """Root-conditioned heads: zero root weights give the plain heads' outputs; trained ones depend on the
    root token; they round-trip in the shared format only; the decoder's batched proposal equals the module
    on the root's embedding; decoding with them equals generate."""
    from medusa_runtime.measure.calibrate import _head_topk

    from .conftest import hf_greedy

    loaded = tiny_llama()
    lm_head = loaded.model.get_output_embeddings()
    embed = loaded.model.get_input_embeddings()
    plain = _randomise(fresh_heads(4, 2, loaded.hidden_size, loaded.vocab_size), seed=4)
    cond = MedusaHeads(HeadsConfig(4, 2, loaded.hidden_size, loaded.vocab_size, True, root_conditioned=True))
    cond.load_state_dict(plain.state_dict(), strict=False)  # the same blocks, root weights still zero
    h, roots = torch.randn(5, loaded.hidden_size), torch.tensor([7, 7, 3, 9, 60])
    torch.testing.assert_close(cond(h, lm_head, embed(roots)), plain(h, lm_head), rtol=0, atol=0)
    with pytest.raises(HeadsError, match="root token's embedding"):
        cond(h, lm_head)
    _randomise(cond, seed=5)
    out = cond(h, lm_head, embed(roots))  # [5, 4, V]
    assert not torch.allclose(out[0], out[2])  # same hidden state, other root: other proposals
    # the root term sits inside the first block's activation: x + silu(W x + b + U_j e), then block 2
    e = embed(roots)
    for j in range(4):
        b0, b1 = cond.blocks[j][0].linear, cond.blocks[j][1].linear
        x = h + torch.nn.functional.silu(h @ b0.weight.T + b0.bias + e @ cond.root_weight[j].T)
        x = x + torch.nn.functional.silu(x @ b1.weight.T + b1.bias)
        torch.testing.assert_close(out[:, j], lm_head(x), rtol=1e-5, atol=1e-5)
    # calibration ranks with the roots it is given
    assert torch.equal(_head_topk(loaded, cond, h, 4, roots)[0], torch.topk(out, 4, dim=-1).indices)

    with pytest.raises(HeadsError, match="no official-format layout"):
        save_heads(cond, tmp_path / "official", fmt="official", lm_head=lm_head)
    folder = save_heads(cond, tmp_path / "shared", fmt="shared")
    assert json.loads((folder / "config.json").read_text())["medusa_root_conditioned"] is True
    again = load_heads(folder, loaded.hidden_size, loaded.vocab_size)
    assert again.root_conditioned
    torch.testing.assert_close(again(h, lm_head, e), out, rtol=0, atol=0)

    cfg = DecodeConfig(max_new_tokens=30, topk=10)
    decoder = MedusaDecoder(loaded, again, "mc_sim_7b_63", config=cfg)
    hidden = torch.randn(loaded.hidden_size)
    for root in (7, 60):
        top = torch.topk(again(hidden[None], lm_head, embed(torch.tensor([root])))[0], 10, dim=-1).indices
        expect = torch.cat([torch.tensor([root]), top[: decoder.tree.depth].flatten()])
        assert torch.equal(decoder.propose(hidden, root), expect[decoder.step_buffers.candidate_index])
    prompt = [3, 14, 15, 9, 2]
    assert decoder.generate(prompt).token_ids == hf_greedy(loaded, prompt, 30)

    weights = folder / "medusa_lm_head.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if k != "2.root.weight"}, str(weights))
    with pytest.raises(HeadsError, match="lacks root weight '2.root.weight'"):
        load_heads(folder, loaded.hidden_size, loaded.vocab_size)


def _path_heads(loaded, k: int = 4, layers: int = 2) -> MedusaHeads:
    return MedusaHeads(HeadsConfig(k, layers, loaded.hidden_size, loaded.vocab_size, True,
                                   root_conditioned=True, path_conditioned=True))


def test_path_conditioned_heads_read_their_parent_and_round_trip(tmp_path):
    """Path-conditioned heads: zero parent weights give the root-conditioned heads' outputs; head j >= 1
    reads its parent inside the first block's activation; round trip in the shared format; calibration
    ranks with the parents it is given."""
    from medusa_runtime.measure.calibrate import _head_topk

    loaded = tiny_llama()
    lm_head = loaded.model.get_output_embeddings()
    embed = loaded.model.get_input_embeddings()
    root_only = _randomise(MedusaHeads(HeadsConfig(4, 2, loaded.hidden_size, loaded.vocab_size, True,
                                                   root_conditioned=True)), seed=6)
    path = _path_heads(loaded)
    path.load_state_dict(root_only.state_dict(), strict=False)  # parent weights still zero
    h = torch.randn(5, loaded.hidden_size)
    roots, parents = torch.tensor([7, 7, 3, 9, 60]), torch.randint(0, 64, (5, 3))
    torch.testing.assert_close(path(h, lm_head, embed(roots), embed(parents)), root_only(h, lm_head, embed(roots)),
                               rtol=0, atol=0)
    with pytest.raises(HeadsError, match="parent token embedding"):
        path(h, lm_head, embed(roots))
    with pytest.raises(HeadsError, match="root-conditioned too"):
        MedusaHeads(HeadsConfig(4, 1, 8, 8, True, path_conditioned=True))
    _randomise(path, seed=7)
    assert tuple(path.parent_weight.shape) == (3, loaded.hidden_size, loaded.hidden_size)
    out = path(h, lm_head, embed(roots), embed(parents))  # [5, 4, V]
    other = path(h, lm_head, embed(roots), embed((parents + 1) % 64))
    torch.testing.assert_close(other[:, 0], out[:, 0], rtol=0, atol=0)  # head 0 has no parent but the root
    assert not torch.allclose(other[:, 1:], out[:, 1:])  # heads 1..3 read theirs
    e, ep = embed(roots), embed(parents)
    for j in range(4):
        b0, b1 = path.blocks[j][0].linear, path.blocks[j][1].linear
        z = h @ b0.weight.T + b0.bias + e @ path.root_weight[j].T
        if j > 0:
            z = z + ep[:, j - 1] @ path.parent_weight[j - 1].T
        x = h + torch.nn.functional.silu(z)
        x = x + torch.nn.functional.silu(x @ b1.weight.T + b1.bias)
        torch.testing.assert_close(out[:, j], lm_head(x), rtol=1e-5, atol=1e-5)
    # calibration: position i reads root following[i] and, for head j, parent following[i + j]
    following = torch.tensor([7, 7, 3, 9, 60, 11, 12, 13])
    at = torch.arange(5)[:, None] + torch.arange(1, 4)
    want = path(h, lm_head, embed(following[:5]), embed(following[at]))
    assert torch.equal(_head_topk(loaded, path, h, 4, following)[0], torch.topk(want, 4, dim=-1).indices)

    folder = save_heads(path, tmp_path / "shared", fmt="shared")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["medusa_root_conditioned"] is True and meta["medusa_path_conditioned"] is True
    again = load_heads(folder, loaded.hidden_size, loaded.vocab_size)
    assert again.path_conditioned
    torch.testing.assert_close(again(h, lm_head, e, ep), out, rtol=0, atol=0)
    weights = folder / "medusa_lm_head.safetensors"
    assert "0.parent.weight" not in load_file(str(weights))  # head 0's parent is the root
    save_file({k: v for k, v in load_file(str(weights)).items() if k != "3.parent.weight"}, str(weights))
    with pytest.raises(HeadsError, match="lacks parent weight '3.parent.weight'"):
        load_heads(folder, loaded.hidden_size, loaded.vocab_size)


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "chain:4"])
def test_path_conditioned_decoder_scores_each_node_under_its_parent(tree):
    """The decoder's tree tokens against a node-by-node reference: the node at path p is rank p[-1] of
    head len(p)-1's top-k given the root and the token of node p[:-1]; decoding stays exact, with the
    confidence gate and a lookup chain too."""
    from medusa_runtime.tree.lookup import LookupConfig

    from .conftest import hf_greedy

    loaded = tiny_llama()
    lm_head = loaded.model.get_output_embeddings()
    embed = loaded.model.get_input_embeddings()
    heads = _randomise(_path_heads(loaded), seed=8)
    decoder = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(max_new_tokens=30, topk=10))
    hidden = torch.randn(loaded.hidden_size)
    for root in (7, 60):
        token = {(): root}
        for p in decoder.tree.paths:  # official order: parents first
            parent = torch.full((3,), token[p[:-1]])
            logits = heads(hidden[None], lm_head, embed(torch.tensor([root])), embed(parent)[None])[0]
            token[p] = int(torch.topk(logits[len(p) - 1], 10).indices[p[-1]])
        expect = torch.tensor([root] + [token[p] for p in decoder.tree.paths])
        assert torch.equal(decoder.propose(hidden, root), expect)
    prompt = [3, 14, 15, 9, 2, 3, 14, 15]
    want = hf_greedy(loaded, prompt, 30)
    assert decoder.generate(prompt).token_ids == want
    for cfg in (DecodeConfig(max_new_tokens=30, topk=10, gate=0.2),
                DecodeConfig(max_new_tokens=30, topk=10, gate=0.2, lookup=LookupConfig(num_tokens=3, min_ngram=1))):
        assert MedusaDecoder(loaded, heads, tree, config=cfg).generate(prompt).token_ids == want


def test_official_heads_whose_config_miscounts_them_load_with_a_warning_and_decode_exactly(tmp_path):
    """A published checkpoint whose medusa_num_heads disagrees with its weights: the weights' count is
    loaded, a warning names both, and decoding with a tree that needs every loaded head equals generate."""
    from .conftest import hf_greedy

    loaded = tiny_llama()
    heads = _randomise(MedusaHeads(HeadsConfig(3, 1, loaded.hidden_size, loaded.vocab_size, shared_lm_head=False)))
    folder = save_heads(heads, tmp_path / "official", fmt="official")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["medusa_num_heads"] = 5
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="medusa_num_heads=5 but the weights hold 3 heads"):
        again = load_heads(folder, loaded.hidden_size, loaded.vocab_size)
    assert again.num_heads == 3
    h = torch.randn(4, loaded.hidden_size)
    torch.testing.assert_close(again(h), heads(h), rtol=0, atol=0)
    prompt = [5, 17, 2, 40, 9]
    decoder = MedusaDecoder(loaded, again, "chain:3", config=DecodeConfig(max_new_tokens=24))
    assert decoder.generate(prompt).token_ids == hf_greedy(loaded, prompt, 24)
