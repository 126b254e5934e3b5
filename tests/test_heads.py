"""Medusa heads: identity at init, both checkpoint formats round-trip, mismatches refused."""

from __future__ import annotations

import json

import pytest
import torch

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
