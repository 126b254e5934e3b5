"""Medusa heads: identity at init, both checkpoint formats round-trip, mismatches refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import (
    HeadsConfig,
    HeadsError,
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
    from medusa_runtime.calibrate import _head_topk

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
    top = _head_topk(loaded, heads, h, 4)  # [5, 4, 4]
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


def test_root_conditioned_heads_read_the_root_and_round_trip(tmp_path):
    """Root-conditioned heads: zero root weights give the plain heads' outputs; trained ones depend on the
    root token; they round-trip in the shared format only; the decoder's batched proposal equals the module
    on the root's embedding; decoding with them equals generate."""
    from medusa_runtime.calibrate import _head_topk

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
    assert torch.equal(_head_topk(loaded, cond, h, 4, roots), torch.topk(out, 4, dim=-1).indices)

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
