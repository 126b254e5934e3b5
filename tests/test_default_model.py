"""The real default model (SmolLM2-135M-Instruct, offline): load, decode, greedy equality with transformers."""

from __future__ import annotations

import random

import pytest
import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.heads.medusa import fresh_heads, resolve_heads
from medusa_runtime.model import describe_model, load_model
from treesearch.tree import load_tree

from .conftest import OracleHeads, hf_greedy
from .test_decode_tiny import tree_logits_vs_sequential
from .test_tree import random_tree


def test_default_model_is_the_pinned_smollm2(default_model):
    info = describe_model(default_model)
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["parameters"] == 134_515_008
    assert (info["layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert info["tied_embeddings"] and info["chat_template"]
    assert default_model.eos_token_ids == (2,)


@pytest.mark.parametrize("index", [0, 21, 62])  # writing, reasoning, coding
def test_fresh_heads_mc_sim_equals_hf_generate(default_model, mt_bench_first_turns, index):
    prompt = encode_prompt(default_model, mt_bench_first_turns[index]["turns"][0], chat=True)
    ref = hf_greedy(default_model, prompt, 24)
    heads = fresh_heads(5, 1, default_model.hidden_size, default_model.vocab_size)
    res = MedusaDecoder(default_model, heads, "mc_sim_7b_63", config=DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert res.token_ids == ref


def test_oracle_heads_on_default_model(default_model, mt_bench_first_turns):
    """Multi-token acceptance and cache compaction on the real model, still token-exact."""
    prompt = encode_prompt(default_model, mt_bench_first_turns[40]["turns"][0], chat=True)
    ref = hf_greedy(default_model, prompt, 40)
    oracle = OracleHeads(default_model, prompt + ref, num_heads=4, topk=10, max_rank=3, miss=0.1)
    res = MedusaDecoder(default_model, oracle, "mc_sim_7b_63", config=DecodeConfig(max_new_tokens=40)).generate(prompt)
    assert res.token_ids == ref
    assert res.stats.tau > 2.0


def test_tree_attention_on_default_model(default_model):
    rng = random.Random(7)
    tree = random_tree(rng, 12, 3, 3)
    prompt = default_model.tokenizer("The capital of France is")["input_ids"]
    tokens = torch.tensor([rng.randrange(default_model.vocab_size) for _ in range(tree.num_nodes)])
    tree_logits, seq_logits = tree_logits_vs_sequential(default_model, tree, prompt, tokens)
    torch.testing.assert_close(tree_logits, seq_logits, atol=1e-3, rtol=1e-4)


def test_shipped_heads_draft_vocabulary_bf16_projection(default_model, mt_bench_first_turns):
    """The shipped heads carry their training vocabulary; the decoder's prepacked bf16 projection of it
    proposes what the module path (full logits, -inf outside the vocabulary) ranks first."""
    bf16 = load_model("default", "bfloat16", log=lambda m: None)
    heads = resolve_heads("default", bf16.hidden_size, bf16.vocab_size)
    assert heads.draft_vocab is not None and 1000 < heads.draft_vocab.numel() < bf16.vocab_size
    decoder = MedusaDecoder(bf16, heads, "chain:3", config=DecodeConfig(max_new_tokens=24, topk=1))
    prompt = encode_prompt(bf16, mt_bench_first_turns[10]["turns"][0], chat=True)
    hidden = decoder.prefill(torch.tensor(prompt), decoder.new_cache(len(prompt) + 8))[1][-1]
    proposed = decoder.propose(hidden, root=7)[1:]  # the heads' top-1 on three levels
    with torch.inference_mode():
        embed = bf16.model.get_input_embeddings()
        root = embed(torch.tensor(7)) if heads.root_conditioned else None
        # path-conditioned heads: head j >= 1 reads the level above's proposal as its parent
        parents = embed(proposed[: heads.num_heads - 1]) if heads.path_conditioned else None
        reference = heads(hidden, bf16.model.get_output_embeddings(), root, parents)[:3].float()  # [3, V]
    chosen = reference.gather(-1, proposed[:, None])[:, 0]
    # ties aside, the proposal is the module's argmax (bf16 kernels may round a near-tie differently)
    assert torch.all(chosen >= reference.amax(-1) - 0.05)
    assert set(proposed.tolist()) <= set(heads.draft_vocab.tolist())
    # and in float32, shipped heads drafting from their vocabulary decode exactly what generate does
    f32 = MedusaDecoder(default_model, resolve_heads("default", bf16.hidden_size, bf16.vocab_size), "chain:3",
                        config=DecodeConfig(max_new_tokens=24))
    res = f32.generate(prompt)
    assert res.token_ids == hf_greedy(default_model, prompt, 24) and res.stats.tau > 1.0


def test_shipped_medusa2_heads_decode_exactly_on_their_adapted_base(default_model, mt_bench_first_turns):
    """The shipped default is Medusa-2: its adapter matches the default base and merges into layers 26-29
    only; greedy Medusa decoding on the adapted base equals that base's own greedy decoding (transformers'
    generate in float32, the runtime's plain decoding in bf16); the Medusa-1 set beside it needs no adapter."""
    from medusa_runtime.heads.adapter import adapter_info, apply_heads_adapter
    from medusa_runtime.heads.medusa import shipped_heads_dir

    folder = shipped_heads_dir("default")
    info = adapter_info(folder)
    assert info is not None and info.layers == (26, 27, 28, 29) and info.base_model == "default"
    assert adapter_info(shipped_heads_dir("medusa1")) is None
    adapted = apply_heads_adapter(default_model, folder, log=lambda m: None)
    assert adapted.name == f"default+adapter:{info.base_digest[:8]}"
    original = dict(default_model.model.named_parameters())
    changed = {n.split(".")[2] for n, p in adapted.model.named_parameters() if not torch.equal(p, original[n])}
    assert changed == {"26", "27", "28", "29"}  # model.layers.<i>...: the adapted layers, nothing else
    heads = resolve_heads("default", adapted.hidden_size, adapted.vocab_size)
    bf16 = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), folder, log=lambda m: None)
    for index in (3, 45):  # writing, math
        prompt = encode_prompt(adapted, mt_bench_first_turns[index]["turns"][0], chat=True)
        res = MedusaDecoder(adapted, heads, "chain:3", config=DecodeConfig(max_new_tokens=32)).generate(prompt)
        assert res.token_ids == hf_greedy(adapted, prompt, 32)
        fast = MedusaDecoder(bf16, heads, "mc_sim_7b_63", config=DecodeConfig(max_new_tokens=32)).generate(prompt)
        plain = MedusaDecoder(bf16, None, None, config=DecodeConfig(max_new_tokens=32)).generate(prompt)
        assert fast.token_ids == plain.token_ids and fast.stats.tau > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "vicuna_7b_stage1"])
def test_all_mt_bench_first_turns_greedy_exact(default_model, mt_bench_first_turns, tree):
    """Every MT-Bench first turn: Medusa greedy with fresh heads == transformers generate (float32)."""
    heads = fresh_heads(5, 1, default_model.hidden_size, default_model.vocab_size)
    decoder = MedusaDecoder(default_model, heads, load_tree(tree), config=DecodeConfig(max_new_tokens=48))
    mismatches = []
    for q in mt_bench_first_turns:
        prompt = encode_prompt(default_model, q["turns"][0], chat=True)
        if decoder.generate(prompt).token_ids != hf_greedy(default_model, prompt, 48):
            mismatches.append(q["question_id"])
    assert mismatches == []


def test_draft_vocab_command_keeps_the_most_frequent_reply_tokens_of_the_heads(tmp_path, mt_bench_first_turns):
    """`medusa-bench draft-vocab`: a copy of the shipped heads whose draft vocabulary is the S tokens most
    frequent in the replies among those the heads had (checked against a brute-force count), weights
    unchanged byte for byte, and decoding drafts only from it; a non-empty --out is refused."""
    import json
    from collections import Counter

    from bench.cli import main
    from medusa_runtime.heads.medusa import shipped_heads_dir

    src = shipped_heads_dir("default")
    rng = random.Random(0)
    kept = json.loads((src / "draft_vocab.json").read_text())
    replies = tmp_path / "replies.jsonl"
    lines = []
    for i in range(30):
        ids = [rng.choice(kept[:300]) for _ in range(40)]  # token draws skewed to 300 of the heads' tokens
        ids += [rng.randrange(49152) for _ in range(5)]  # and a few anywhere in the vocabulary
        lines.append(json.dumps({"turns": [f"q{i}"], "input_ids": [1, 2, 3] + ids, "reply_start": 3}))
    replies.write_text("\n".join(lines) + "\n" + '{"turns": ["cut by a crash"')
    out = tmp_path / "cut"
    assert main(["draft-vocab", "--heads", "default", "--size", "64", "--replies", str(replies), "--dtype", "float32",
                 "--out", str(out)]) == 0
    counts = Counter(t for line in lines for t in json.loads(line)["input_ids"][3:] if t in set(kept))
    expected = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:64])
    assert json.loads((out / "draft_vocab.json").read_text()) == expected
    assert (out / "medusa_lm_head.safetensors").read_bytes() == (src / "medusa_lm_head.safetensors").read_bytes()
    meta = json.loads((out / "config.json").read_text())
    assert meta["medusa_draft_vocab_cut"]["replies_read"] == 30 and meta["medusa_num_heads"] == 4
    loaded = load_model("default", "float32", log=lambda m: None)
    heads = resolve_heads(str(out), loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, "chain:3", config=DecodeConfig(max_new_tokens=16))
    prompt = encode_prompt(loaded, mt_bench_first_turns[5]["turns"][0], chat=True)
    hidden = dec.prefill(torch.tensor(prompt), dec.new_cache(len(prompt) + 8))[1][-1]
    assert set(dec.propose(hidden, root=7)[1:].tolist()) <= set(expected)
    # a non-empty folder, or more tokens than the heads have: one-line errors, exit 2
    assert main(["draft-vocab", "--heads", "default", "--size", "64", "--replies", str(replies), "--out", str(out)]) == 2
    assert main(["draft-vocab", "--heads", "default", "--size", "20000", "--replies", str(replies), "--out",
                 str(tmp_path / "big")]) == 2
