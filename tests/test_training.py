"""Head training: the seeds' loss alignment, skipping, Medusa-1 learning and resume, Medusa-2 smoke, data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import fresh_heads, load_heads
from medusa_runtime.model import LoadedModel
from medusa_runtime.prompts import (
    BUILTIN_SOURCE,
    CATEGORIES,
    DETAILED_SOURCE,
    OPEN_SOURCE,
    WIDE_SOURCE,
    Prompt,
    builtin_prompts,
    builtin_split,
    load_prompt_source,
)
from medusa_runtime.training.distill import DistillConfig, Example, build_distill_data
from medusa_runtime.training.train import (
    HeadTrainer,
    TrainConfig,
    evaluate_heads,
    head_targets,
    labels_for,
    medusa_loss,
    train_medusa1,
    train_medusa2,
)

from .conftest import hf_greedy, tiny_llama  # noqa: F401  (tiny_examples: a conftest fixture)


def test_loss_alignment_worked_example():
    """Batch 2, sequence 3, vocabulary 5: head 0 (shift 2) predicts labels[:, 2] from logits[:, 0];
    head 1 (shift 3) has no valid position and is skipped."""
    torch.manual_seed(0)
    logits0 = torch.randn(2, 3, 5)
    logits1 = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 4, 2], [0, 3, 3]])
    total, stats = medusa_loss([logits0, logits1], labels, loss_decay=0.8)
    expected = F.cross_entropy(logits0[:, 0], labels[:, 2])
    assert stats[1] is None
    assert stats[0].positions == 2
    torch.testing.assert_close(total, 0.8 * expected)
    mask, targets = head_targets(labels, 2)
    assert mask.tolist() == [[True, False, False], [True, False, False]]
    assert targets[:, 0].tolist() == [2, 3]
    # ignored labels (-100, e.g. prompt tokens) are never targets
    labels[0, 2] = -100
    _, stats = medusa_loss([logits0, logits1], labels)
    assert stats[0].positions == 1


def test_self_distillation_data_is_the_models_own_greedy_reply(tiny_examples):
    loaded, prompts, examples, store = tiny_examples
    assert (store.root / "manifest.json").is_file()
    n_follow = sum(len(p.turns) > 1 for p in prompts)
    assert len(examples) == len(prompts) + n_follow
    ex = next(e for e in examples if e.turn == 0)
    context = list(ex.input_ids[: ex.reply_start])
    assert list(ex.input_ids[ex.reply_start:]) == hf_greedy(loaded, context, 24)
    # a rerun reuses the store: no generation needed, same examples
    cfg = DistillConfig(max_new_tokens=24, batch_size=8)
    again, store2 = build_distill_data(loaded, prompts, cfg, progress=False)
    assert store2.root == store.root and again == examples and len(store2.shards) == len(store.shards)
    # replies are kept per conversation: another prompt set reuses them and generates only what is new
    other = [prompts[5], prompts[2], Prompt(("Name three colours.",), "writing")]
    subset, store3 = build_distill_data(loaded, other, cfg, progress=False)
    assert store3.root == store.root and len(store3.replies) == len(store2.replies) + 1
    assert store3.shards[-1]["replies"] == 1
    by_turns = {(prompts[e.prompt_index].turns, e.turn): e.input_ids for e in examples}
    reused = [e for e in subset if e.prompt_index < 2]
    assert len(reused) == len(other[0].turns) + len(other[1].turns)
    assert all(e.input_ids == by_turns[(other[e.prompt_index].turns, e.turn)] for e in reused)
    assert [(e.prompt_index, e.turn) for e in subset] == sorted((e.prompt_index, e.turn) for e in subset)


def test_medusa1_learns_and_resumes(tiny_examples, tmp_path):
    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(num_heads=2, epochs=30, lr=1e-2, batch_tokens=256, val_fraction=0.0, checkpoint_every=5)
    out = tmp_path / "run"
    res = train_medusa1(loaded, examples, cfg, out, progress=False, log=lambda m: None)
    assert (out / "heads" / "config.json").is_file() and (out / "heads-official" / "config.json").is_file()
    rec = json.loads((out / "training.json").read_text())
    assert rec["steps"] == res.steps > 5
    first, last = rec["history"][0]["loss"], rec["history"][-1]["loss"]
    assert last < 0.8 * first
    # the trained heads beat fresh ones on the data they saw
    hidden = [loaded.model(torch.tensor([e.input_ids]), output_hidden_states=True).hidden_states[-1][0]
              for e in examples[:10]]
    labels = [labels_for(e, cfg.max_len)[1] for e in examples[:10]]
    w = loaded.model.get_output_embeddings().weight.detach()
    trained = load_heads(out / "heads", loaded.hidden_size, loaded.vocab_size)
    acc_trained = evaluate_heads(HeadTrainer(trained, w, cfg), hidden, labels)
    acc_fresh = evaluate_heads(HeadTrainer(fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size), w, cfg),
                               hidden, labels)
    assert acc_trained[0][0] > acc_fresh[0][0] and acc_trained[0][4] > acc_fresh[0][4] + 0.05
    # both written formats decode identically
    official = load_heads(out / "heads-official", loaded.hidden_size, loaded.vocab_size)
    prompt = list(examples[0].input_ids[: examples[0].reply_start])
    a = MedusaDecoder(loaded, trained, "chain:2", config=DecodeConfig(max_new_tokens=20)).generate(prompt)
    b = MedusaDecoder(loaded, official, "chain:2", config=DecodeConfig(max_new_tokens=20)).generate(prompt)
    assert a.token_ids == b.token_ids and a.stats.accept_lengths == b.stats.accept_lengths
    # resume: a longer run continues from the checkpoint instead of starting over
    longer = TrainConfig(**{**cfg.__dict__, "epochs": 34})
    res2 = train_medusa1(loaded, examples, longer, out, resume=True, progress=False, log=lambda m: None)
    rec2 = json.loads((out / "training.json").read_text())
    assert res2.steps > res.steps and len(rec2["history"]) == res2.steps
    assert rec2["history"][: res.steps] == rec["history"][: res.steps]


def test_base_hidden_states_kept_on_disk(tiny_examples, monkeypatch):
    """Medusa-1's base hidden states are written once (atomically) and reloaded unchanged; other data,
    another max_len or a damaged file means the backbone runs again."""
    import medusa_runtime.training.hidden_cache as train_mod  # the cache's own module (train re-exports it)

    loaded, _, examples, _ = tiny_examples
    exs = examples[:6]
    first = train_mod.base_hidden_states(loaded, exs, 64, progress=False, log=lambda m: None)
    path = train_mod.hidden_cache_file(loaded, exs, 64)
    assert path.is_file() and not list(path.parent.glob(".*.tmp"))
    # each example's states are the backbone's last hidden states of its first max_len tokens (bf16)
    ref = loaded.model(torch.tensor([exs[0].input_ids[:64]]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.equal(first[0], ref.to(torch.bfloat16))
    runs = []
    real = train_mod.cache_hidden_states
    monkeypatch.setattr(train_mod, "cache_hidden_states", lambda *a, **k: runs.append(1) or real(*a, **k))
    again = train_mod.base_hidden_states(loaded, exs, 64, progress=False, log=lambda m: None)
    assert not runs and len(again) == len(first) and all(torch.equal(a, b) for a, b in zip(again, first))
    assert train_mod.hidden_cache_file(loaded, exs, 32) != path != train_mod.hidden_cache_file(loaded, exs[1:], 64)
    train_mod.base_hidden_states(loaded, exs[1:], 64, progress=False, log=lambda m: None)
    assert runs == [1]
    path.write_bytes(b"not safetensors")
    healed = train_mod.base_hidden_states(loaded, exs, 64, progress=False, log=lambda m: None)
    assert runs == [1, 1] and all(torch.equal(a, b) for a, b in zip(healed, first))
    train_mod.base_hidden_states(loaded, exs, 64, progress=False, use_cache=False, log=lambda m: None)
    assert runs == [1, 1, 1]
    # a failed write (full disk) keeps the states of this run and leaves no partial file behind
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train_mod, "save_file", disk_full)
    logs = []
    kept = train_mod.base_hidden_states(loaded, exs[2:], 64, progress=False, log=logs.append)
    assert len(kept) == 4 and torch.equal(kept[0], first[2]) and "No space left" in logs[-1]
    assert not train_mod.hidden_cache_file(loaded, exs[2:], 64).exists() and not list(path.parent.glob(".*.tmp"))


def _interrupt_on_call(monkeypatch, owner, name: str, call: int) -> None:
    """Ctrl-C on the ``call``-th call of ``owner.name`` (a training step's loss)."""
    original = getattr(owner, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def _tensors(folder):
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("method", ["medusa1", "medusa2"])
def test_interrupted_training_resumes_to_the_uninterrupted_result(tiny_examples, tmp_path, monkeypatch, method):
    """Ctrl-C mid-run keeps the last checkpoint; --resume then ends with exactly the heads (and, for
    Medusa-2, the base) of a run that was never interrupted, having trained on the same batches."""
    import medusa_runtime.training.train as train_mod

    loaded, _, examples, _ = tiny_examples
    if method == "medusa1":
        cfg = TrainConfig(num_heads=2, epochs=3, lr=1e-2, batch_tokens=256, val_fraction=0.0, checkpoint_every=3)
        run, data, owner, name = train_medusa1, examples, HeadTrainer, "batch_loss"
    else:
        cfg = TrainConfig(method="medusa2", num_heads=2, epochs=2, batch_tokens=512, val_fraction=0.0,
                          heads_warmup_ratio=0.25, base_lr=1e-4, checkpoint_every=3)
        run, data, owner, name = train_medusa2, examples[:16], train_mod, "_medusa2_loss"
    quiet = {"progress": False, "log": lambda m: None}
    whole = run(loaded, data, cfg, tmp_path / "whole", **quiet)
    assert whole.steps > cfg.checkpoint_every + 2
    with monkeypatch.context() as m:
        _interrupt_on_call(m, owner, name, cfg.checkpoint_every + 2)  # one step past a checkpoint is lost
        with pytest.raises(KeyboardInterrupt):
            run(loaded, data, cfg, tmp_path / "cut", **quiet)
    assert not (tmp_path / "cut" / "training.json").exists()
    assert torch.load(tmp_path / "cut" / "checkpoint" / "trainer.pt", weights_only=False)["step"] == cfg.checkpoint_every
    resumed = run(loaded, data, cfg, tmp_path / "cut", resume=True, **quiet)
    assert resumed.steps == whole.steps and resumed.history == whole.history
    for folder in (["heads", "heads-official"] + (["base"] if method == "medusa2" else [])):
        a, b = _tensors(tmp_path / "whole" / folder), _tensors(tmp_path / "cut" / folder)
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k], b[k]), k
    # a checkpoint made under another configuration is refused, not silently mixed in
    with pytest.raises(ValueError, match="cannot resume.*lr"):
        run(loaded, data, TrainConfig(**{**cfg.__dict__, "lr": 5e-3}), tmp_path / "cut", resume=True, **quiet)


def test_replies_vocabulary_is_saved_as_the_draft_vocabulary(tiny_examples, tmp_path):
    """Heads trained on the replies' vocabulary keep it: they propose only tokens they were trained on."""
    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(num_heads=2, epochs=1, batch_tokens=256, val_fraction=0.0, vocab="replies")
    train_medusa1(loaded, examples, cfg, tmp_path / "run", progress=False, log=lambda m: None)
    replies = sorted({t for e in examples for t in e.input_ids[e.reply_start:cfg.max_len]})
    for folder in ("heads", "heads-official"):
        heads = load_heads(tmp_path / "run" / folder, loaded.hidden_size, loaded.vocab_size)
        assert heads.draft_vocab.tolist() == replies
    # --draft-size S: the S most frequent reply tokens only (counted here by hand)
    counts: dict[int, int] = {}
    for e in examples:
        for t in e.input_ids[e.reply_start:cfg.max_len]:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    cut = ranked[9][1]  # the 10th count: tokens above it are in, those below out (ties either way)
    train_medusa1(loaded, examples, TrainConfig(**{**cfg.__dict__, "draft_size": 10}), tmp_path / "small",
                  progress=False, log=lambda m: None)
    small = set(load_heads(tmp_path / "small" / "heads", loaded.hidden_size, loaded.vocab_size).draft_vocab.tolist())
    assert len(small) == 10 and {t for t, c in counts.items() if c > cut} <= small
    assert all(counts[t] >= cut for t in small)
    with pytest.raises(ValueError, match="draft_size"):
        TrainConfig(draft_size=10)  # needs vocab 'replies'


def test_training_goes_on_from_heads_trained_before(tiny_examples, tmp_path):
    """``init``: a run starts from the given heads (at learning rate 0 it writes them back unchanged),
    their draft vocabulary grows by the new replies' tokens, training.json names them, and heads of
    another shape are refused with what to change."""
    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(num_heads=2, epochs=3, lr=1e-2, batch_tokens=256, val_fraction=0.0, vocab="replies",
                      condition="path")
    first, second = examples[:12], examples[12:]
    train_medusa1(loaded, first, cfg, tmp_path / "a", progress=False, log=lambda m: None)
    before = load_heads(tmp_path / "a" / "heads", loaded.hidden_size, loaded.vocab_size)
    frozen = TrainConfig(**{**cfg.__dict__, "lr": 0.0, "epochs": 1})
    train_medusa1(loaded, second, frozen, tmp_path / "b", progress=False, log=lambda m: None,
                  init=str(tmp_path / "a" / "heads"))
    after = load_heads(tmp_path / "b" / "heads", loaded.hidden_size, loaded.vocab_size)
    assert after.state_dict().keys() == before.state_dict().keys()
    assert all(torch.equal(after.state_dict()[k], v) for k, v in before.state_dict().items())
    new_tokens = {t for e in second for t in e.input_ids[e.reply_start:cfg.max_len]}
    assert after.draft_vocab.tolist() == sorted(set(before.draft_vocab.tolist()) | new_tokens)
    assert len(after.draft_vocab) > len(before.draft_vocab)
    rec = json.loads((tmp_path / "b" / "training.json").read_text())
    assert rec["init"]["heads"] == str(tmp_path / "a" / "heads") and rec["init"]["config"]["lr"] == cfg.lr
    # and at a learning rate above 0 they move from there
    train_medusa1(loaded, second, cfg, tmp_path / "c", progress=False, log=lambda m: None,
                  init=str(tmp_path / "a" / "heads"))
    moved = load_heads(tmp_path / "c" / "heads", loaded.hidden_size, loaded.vocab_size)
    assert not torch.equal(moved.blocks[0][0].linear.weight, before.blocks[0][0].linear.weight)
    for other in ({"num_layers": 2}, {"num_heads": 3}, {"condition": "root"}):
        with pytest.raises(ValueError, match="set --num-heads, --layers and --condition to match"):
            train_medusa1(loaded, second, TrainConfig(**{**cfg.__dict__, **other}), tmp_path / "d",
                          progress=False, log=lambda m: None, init=str(tmp_path / "a" / "heads"))


@pytest.mark.parametrize("subset", [None, [0, 2, 3, 5, 7, 8, 10]])
def test_soft_targets_loss_against_a_direct_computation(subset):
    """soft_targets = a: head j at position t pays (1 - a) CE(label t+j+2) + a CE(p), p the base's own
    next-token distribution from its hidden state at t+j+1, over the same vocabulary rows."""
    torch.manual_seed(0)
    hidden_size, vocab, a = 16, 11, 0.6
    heads = fresh_heads(2, 1, hidden_size, vocab)
    with torch.no_grad():
        for blocks in heads.blocks:
            blocks[0].linear.weight.normal_(0, 0.3)
    w = torch.randn(vocab, hidden_size)
    hiddens = [torch.randn(7, hidden_size), torch.randn(5, hidden_size)]
    labels = [torch.tensor([-100, -100, 3, 5, 0, 7, 2]), torch.tensor([-100, 8, 2, 10, 5])]
    cfg = TrainConfig(num_heads=2, soft_targets=a)
    sub = None if subset is None else torch.tensor(subset)
    loss, stats = HeadTrainer(heads, w, cfg, sub).batch_loss(hiddens, labels)
    rows = torch.arange(vocab) if sub is None else sub
    expected = 0.0
    with torch.no_grad():
        for j in range(2):
            terms = []
            for h, lab in zip(hiddens, labels):
                for t in range(len(lab) - j - 2):
                    target = int(lab[t + j + 2])
                    if target == -100 or target not in rows.tolist():
                        continue
                    q = F.log_softmax(heads.head_states(h[t])[j] @ w[rows].T, -1)
                    p = F.softmax(h[t + j + 1] @ w[rows].T, -1)
                    hard = -q[rows.tolist().index(target)]
                    terms.append((1 - a) * hard + a * -(p * q).sum())
            assert stats[j].positions == len(terms)
            expected += 0.8 ** (j + 1) * torch.stack(terms).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=3e-2, atol=3e-2)  # bf16 autocast in training
    hard_only, _ = HeadTrainer(heads, w, TrainConfig(num_heads=2), sub).batch_loss(hiddens, labels)
    assert abs(float(loss.detach()) - float(hard_only.detach())) > 0.05  # the soft term is really there


def test_root_conditioned_loss_reads_the_next_token_embedding():
    """condition = root: head j at position t reads h_t and the input embedding of token t+1 (the root a
    decoding step from t has), scored against token t+j+2; checked position by position."""
    from medusa_runtime.heads.medusa import HeadsConfig, MedusaHeads

    torch.manual_seed(1)
    hidden_size, vocab = 16, 11
    heads = MedusaHeads(HeadsConfig(2, 1, hidden_size, vocab, True, root_conditioned=True))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    w, embed = torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size)
    hiddens = [torch.randn(7, hidden_size), torch.randn(5, hidden_size)]
    ids = [torch.tensor([4, 9, 3, 5, 0, 7, 2]), torch.tensor([1, 8, 2, 10, 5])]
    labels = [torch.tensor([-100, -100, 3, 5, 0, 7, 2]), torch.tensor([-100, 8, 2, 10, 5])]
    cfg = TrainConfig(num_heads=2, condition="root")
    with pytest.raises(ValueError, match="input embeddings"):
        HeadTrainer(heads, w, cfg)
    trainer = HeadTrainer(heads, w, cfg, embed=embed)
    with pytest.raises(ValueError, match="token ids"):
        trainer.batch_loss(hiddens, labels)
    loss, stats = trainer.batch_loss(hiddens, labels, ids)
    expected = 0.0
    with torch.no_grad():
        for j in range(2):
            terms = []
            for h, row, lab in zip(hiddens, ids, labels):
                for t in range(len(lab) - j - 2):
                    if int(lab[t + j + 2]) == -100:
                        continue
                    state = heads.head_states(h[t], embed[row[t + 1]])[j]
                    terms.append(F.cross_entropy((state @ w.T)[None], lab[t + j + 2][None]))
            assert stats[j].positions == len(terms)
            expected += 0.8 ** (j + 1) * torch.stack(terms).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=3e-2, atol=3e-2)  # bf16 autocast in training
    shifted = [torch.roll(row, 1) for row in ids]  # other roots, same labels: another loss
    assert abs(float(trainer.batch_loss(hiddens, labels, shifted)[0].detach()) - float(loss.detach())) > 0.05


def test_path_conditioned_loss_reads_each_heads_parent():
    """condition = path: head j at position t also reads the embedding of token t+j+1 (its parent in the
    tree; for head 0 that is the root); checked position by position against the module."""
    from medusa_runtime.heads.medusa import HeadsConfig, MedusaHeads

    torch.manual_seed(2)
    hidden_size, vocab, k = 16, 11, 3
    heads = MedusaHeads(HeadsConfig(k, 1, hidden_size, vocab, True, root_conditioned=True, path_conditioned=True))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    w, embed = torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size)
    hiddens = [torch.randn(8, hidden_size), torch.randn(6, hidden_size)]
    ids = [torch.tensor([4, 9, 3, 5, 0, 7, 2, 6]), torch.tensor([1, 8, 2, 10, 5, 3])]
    labels = [torch.tensor([-100, -100, 3, 5, 0, 7, 2, 6]), torch.tensor([-100, 8, 2, 10, 5, 3])]
    trainer = HeadTrainer(heads, w, TrainConfig(num_heads=k, condition="path"), embed=embed)
    loss, stats = trainer.batch_loss(hiddens, labels, ids)
    expected = 0.0
    with torch.no_grad():
        for j in range(k):
            terms = []
            for h, row, lab in zip(hiddens, ids, labels):
                for t in range(len(lab) - j - 2):
                    if int(lab[t + j + 2]) == -100:
                        continue
                    parents = embed[row[t + 2: t + k + 1]]  # tokens t+2 .. t+k (only t+j+1 is read by head j)
                    parents = torch.cat([parents, parents[-1:].expand(k - 1 - len(parents), -1)])
                    state = heads.head_states(h[t], embed[row[t + 1]], parents)[j]
                    terms.append(F.cross_entropy((state @ w.T)[None], lab[t + j + 2][None]))
            assert stats[j].positions == len(terms)
            expected += 0.8 ** (j + 1) * torch.stack(terms).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=3e-2, atol=3e-2)  # bf16 autocast in training
    root_heads = MedusaHeads(HeadsConfig(k, 1, hidden_size, vocab, True, root_conditioned=True))
    root_heads.load_state_dict(heads.state_dict(), strict=False)  # the same heads without parent weights
    base = HeadTrainer(root_heads, w, TrainConfig(num_heads=k, condition="root"), embed=embed).batch_loss(
        hiddens, labels, ids)[0]
    assert abs(float(base.detach()) - float(loss.detach())) > 0.05  # the parents change the loss
    with torch.no_grad():
        heads.parent_weight.zero_()  # zero parent weights: the root-conditioned loss
    torch.testing.assert_close(trainer.batch_loss(hiddens, labels, ids)[0], base, rtol=0, atol=0)


@pytest.mark.parametrize("condition", ["root", "path"])
def test_conditioned_medusa1_trains_and_decodes_exactly(tiny_examples, tmp_path, condition):
    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(num_heads=2, epochs=4, lr=1e-2, batch_tokens=256, val_fraction=0.1, condition=condition,
                      eval_every=7)
    res = train_medusa1(loaded, examples, cfg, tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run" / "heads-official").exists()  # no official layout for these heads
    assert [v["step"] for v in res.validation] == [s for s in range(7, res.steps, 7)] + [res.steps]
    heads = load_heads(tmp_path / "run" / "heads", loaded.hidden_size, loaded.vocab_size)
    assert heads.root_conditioned and float(heads.root_weight.detach().abs().max()) > 0
    assert heads.path_conditioned == (condition == "path")
    if condition == "path":
        assert float(heads.parent_weight.detach().abs().max()) > 0
    prompt = list(examples[0].input_ids[: examples[0].reply_start])
    out = MedusaDecoder(loaded, heads, "chain:2", config=DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert out.token_ids == hf_greedy(loaded, prompt, 24)


def test_medusa2_joint_loss_at_start_is_heads_plus_next_token_ce(tiny_examples):
    """Before the base moves, student == teacher: the joint loss of a padded batch is the heads' loss on
    unpadded single forwards plus the teacher's own next-token cross-entropy on the replies (KL = 0)."""
    import copy

    from medusa_runtime.training.train import _medusa2_loss, padded_batch

    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(method="medusa2", num_heads=2)
    student = copy.deepcopy(loaded.model).float()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    with torch.no_grad():
        for blocks in heads.blocks:
            blocks[0].linear.weight.normal_(0, 0.05)
    trainer = HeadTrainer(heads, student.get_output_embeddings().weight.detach(), cfg)
    batch = sorted(examples[:3], key=lambda e: len(e.input_ids))  # different lengths: padding is exercised
    assert len({len(e.input_ids) for e in batch}) > 1
    ids, labels, attn = padded_batch(batch, cfg.max_len, torch.device("cpu"))
    heads_only, _ = _medusa2_loss(student, loaded.model, trainer, ids, labels, attn, cfg, joint=False)
    joint, _ = _medusa2_loss(student, loaded.model, trainer, ids, labels, attn, cfg, joint=True)
    with torch.no_grad():  # reference: every example alone, float32, no padding
        pairs = [labels_for(e, cfg.max_len) for e in batch]
        outs = [student(input_ids=i[None], output_hidden_states=True) for i, _ in pairs]
        ref_heads, _ = trainer.batch_loss([o.hidden_states[-1][0] for o in outs], [lab for _, lab in pairs])
        logits = torch.cat([o.logits[0, :-1][lab[1:] != -100] for o, (_, lab) in zip(outs, pairs)])
        targets = torch.cat([lab[1:][lab[1:] != -100] for _, lab in pairs])
        ce = F.cross_entropy(logits.float(), targets)
    torch.testing.assert_close(heads_only, ref_heads, rtol=2e-2, atol=2e-2)  # bf16 autocast in training
    torch.testing.assert_close(joint - heads_only, ce, rtol=2e-2, atol=2e-2)
    # gradients reach the base only in the joint phase, the heads' share scaled by head_grad_to_base:
    # the base's gradient is linear in it, so the gradient at 0.5 is the mean of those at 0 and 1
    layer = student.model.layers[0].mlp.down_proj.weight
    layer.requires_grad_(True)
    _medusa2_loss(student, loaded.model, trainer, ids, labels, attn, cfg, joint=False)[0].backward()
    assert layer.grad is None
    grads = {}
    for share in (0.0, 0.5, 1.0):
        layer.grad = None
        share_cfg = TrainConfig(**{**cfg.__dict__, "head_grad_to_base": share})
        _medusa2_loss(student, loaded.model, trainer, ids, labels, attn, share_cfg, joint=True)[0].backward()
        grads[share] = layer.grad.clone()
    assert float(grads[0.0].abs().sum()) > 0 and not torch.allclose(grads[0.0], grads[1.0])
    error = float((grads[0.5] - (grads[0.0] + grads[1.0]) / 2).norm())  # bf16 autocast rounds the backward
    assert error < 0.02 * float(grads[0.5].norm()) and error < 0.05 * float((grads[1.0] - grads[0.0]).norm())


def test_medusa2_smoke(tiny_examples, tmp_path):
    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(method="medusa2", num_heads=2, epochs=1, batch_tokens=512, val_fraction=0.2,
                      heads_warmup_ratio=0.5, base_lr=1e-4, vocab="replies")
    res = train_medusa2(loaded, examples[:16], cfg, tmp_path / "m2", progress=False, log=lambda m: None)
    hist = res.history
    assert any(not h["joint"] for h in hist) and any(h["joint"] for h in hist)
    topk = res.validation[-1]["topk"]  # heads scored on the trained base's hidden states
    assert len(topk) == 2 and all(0 <= a <= b <= 1 for row in topk for a, b in zip(row, row[1:]))
    assert load_heads(tmp_path / "m2" / "heads", loaded.hidden_size, loaded.vocab_size).draft_vocab is not None
    base = tmp_path / "m2" / "base"
    assert (base / "config.json").is_file() and (tmp_path / "m2" / "heads" / "config.json").is_file()
    # the original model is untouched (the teacher stays frozen)
    assert all(not p.requires_grad for p in loaded.model.parameters())


def test_builtin_prompts_cover_categories_and_never_mt_bench(mt_bench_first_turns):
    prompts = load_prompt_source("builtin-all")  # tiers 1-2 (the default), 3 (open questions) and 4 (wider)
    assert len(prompts) >= 600
    assert {p.category for p in prompts} == set(CATEGORIES)
    assert sum(len(p.turns) > 1 for p in prompts) > 100
    assert len({p.turns for p in prompts}) == len(prompts)

    def grams(text, n=6):
        words = re.findall(r"[a-z0-9']+", text.lower())
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}

    mt = set()
    for q in mt_bench_first_turns:
        for t in q["turns"]:
            mt |= grams(t)
    for p in prompts:
        for t in p.turns:
            assert not (grams(t) & mt), f"builtin prompt shares a 6-word span with MT-Bench: {t!r}"


def test_open_and_wide_tiers_are_apart_from_the_default_set_and_split_on_their_own():
    """Tiers 3 and 4 (--data builtin-open, builtin-wide) never change --data builtin (the quick profile,
    the bench's calibration prompts); builtin-all holds all four tiers, each cut at 80 % on its own."""
    default, tier3, tier4, every = (load_prompt_source(s) for s in ("builtin", "builtin-open", "builtin-wide",
                                                                    "builtin-all"))
    assert default == builtin_prompts() and {p.source for p in default} == {BUILTIN_SOURCE, DETAILED_SOURCE}
    for tier, size, source in ((tier3, 500, OPEN_SOURCE), (tier4, 1200, WIDE_SOURCE)):
        assert len(tier) == size and {p.source for p in tier} == {source}
        assert {p.category for p in tier} == set(CATEGORIES) and len({p.turns for p in tier}) == size
        assert 0.25 * size < sum(len(p.turns) > 1 for p in tier) < 0.45 * size  # about 35 % with a follow-up
        assert builtin_split(tier, "train") == tier[:int(size * 0.8)]
    assert every == default + tier3 + tier4  # and every prompt of every tier is distinct
    assert len({p.turns for p in every}) == len(every)
    assert load_prompt_source("builtin-open") == tier3 and load_prompt_source("builtin-wide") == tier4  # deterministic
    train_all = builtin_split(every, "train")
    for tier, source in ((tier3, OPEN_SOURCE), (tier4, WIDE_SOURCE)):
        assert [p for p in train_all if p.source == source] == builtin_split(tier, "train")
    assert [p for p in train_all if p.source not in (OPEN_SOURCE, WIDE_SOURCE)] == builtin_split(default, "train")


def test_builtin_tiers_are_the_data_files_as_they_were_composed():
    """The built-in prompts are data files (medusa_runtime/data/prompts) read through the user's prompt-file
    path; each tier's prompts (turns, category, source, id, in order) hash to what the Python composer that
    preceded the files produced, so every cache keyed on the built-in set stays valid."""
    import hashlib

    from medusa_runtime.prompts import TIER_FILES, tier_prompts

    composed = {BUILTIN_SOURCE: "d0f7bf426b47eb17004cb98c85ef72cb4c28727a0ae6919f0a5827a4ddcd3fcb",
                DETAILED_SOURCE: "584f4f9b39b6f41ba30db9fae1842856ed8c909fb931e75e868fa26f456c18ab",
                OPEN_SOURCE: "79b7a0e22fe66255f66765e653dab97d3259b1dc489f5f75bf01e8dbe0db5046",
                WIDE_SOURCE: "5a0bdade92f6a82a3ef0898799091d8178b82b14fdec512f579372cf63a4db86"}
    assert set(TIER_FILES) == set(composed)
    for source, digest in composed.items():
        prompts = tier_prompts(source)
        text = json.dumps([[list(p.turns), p.category, p.source, p.id] for p in prompts], ensure_ascii=False)
        assert hashlib.sha256(text.encode()).hexdigest() == digest, source
    # a user's file of the same records reads the same prompts (one path for both)
    assert load_prompt_source(str(Path(__file__).parents[1] / "medusa_runtime" / "data" / "prompts" /
                                  TIER_FILES[OPEN_SOURCE]))[0].turns == tier_prompts(OPEN_SOURCE)[0].turns


def test_builtin_tiers_split_separately_and_interleave():
    prompts = builtin_prompts()
    tiers = {}
    for p in prompts:
        tiers.setdefault(p.source, []).append(p)
    assert set(tiers) == {BUILTIN_SOURCE, DETAILED_SOURCE}
    detailed = tiers[DETAILED_SOURCE]
    assert len(detailed) == 640 and all(sum(p.category == c for p in detailed) == 80 for c in CATEGORIES)
    assert sum(len(p.turns) > 1 for p in detailed) > 150
    assert builtin_prompts() == prompts  # deterministic
    train, calib = builtin_split(prompts, "train"), builtin_split(prompts, "calibration")
    assert not {p.turns for p in train} & {p.turns for p in calib}
    assert len(train) + len(calib) == len(prompts)
    for tier in tiers.values():  # each tier's own first 80 % trains, in its own order
        cut = int(len(tier) * 0.8)
        assert [p for p in train if p.source == tier[0].source] == tier[:cut]
        assert [p for p in calib if p.source == tier[0].source] == tier[cut:]
    # any prefix holds both tiers in proportion (the quick profile takes the first 360)
    share = len(tiers[DETAILED_SOURCE]) * 0.8 / len(train)
    n_detailed = sum(p.source == DETAILED_SOURCE for p in train[:360])
    assert abs(n_detailed - 360 * share) <= 2
    with pytest.raises(ValueError, match="part"):
        builtin_split(prompts, "test")


def test_prompt_sources(tmp_path):
    share = [{"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"},
                                {"from": "human", "value": "and again"}]}]
    (tmp_path / "s.json").write_text(json.dumps(share))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert load_prompt_source(str(tmp_path / "s.json"))[0].turns == ("hello there", "and again")
    assert [p.turns for p in load_prompt_source(str(tmp_path / "p.jsonl"))] == [("one",), ("two",)]
    with pytest.raises(FileNotFoundError):
        load_prompt_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="not valid"):
        load_prompt_source(str(tmp_path / "bad.jsonl"))


def test_example_labels_mask_the_context():
    ex = Example((5, 6, 7, 8, 9), 3, 0, 0)
    ids, labels = labels_for(ex, 10)
    assert labels.tolist() == [-100, -100, -100, 8, 9] and ids.tolist() == [5, 6, 7, 8, 9]


def test_fidelity_against_direct_computation():
    """Medusa-2 drift measure: a model against itself agrees fully; a perturbed copy's figures match
    a direct computation (sequential log-softmax, position-by-position agreement)."""
    import copy

    from bench.judge.proxies import fidelity
    from bench.replay.mtbench import Question
    from bench.replay.workload import spread_over_categories

    original = tiny_llama(vocab=32, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9, 8]]
    same = fidelity(original, original, prompts, 10, batch_size=2, progress=False)
    assert same.agreement == 1.0 and same.identical == 1.0 and same.ll_drop == pytest.approx(0.0, abs=1e-6)
    model = copy.deepcopy(original.model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(torch.randn_like(model.model.layers[0].mlp.down_proj.weight))
    trained = LoadedModel(model, None, "perturbed", torch.float32, torch.device("cpu"))
    res = fidelity(original, trained, prompts, 10, batch_size=2, progress=False)
    ref = [hf_greedy(original, p, 10) for p in prompts]
    got = [hf_greedy(trained, p, 10) for p in prompts]
    agree = sum(sum(a == b for a, b in zip(g, r)) / max(len(g), len(r)) for g, r in zip(got, ref)) / 3
    assert res.agreement == pytest.approx(agree) and res.agreement < 1.0

    def ll(m, p, a):  # token-weighted mean log p(a | p) by one forward per token
        out = []
        for i, tok in enumerate(a):
            logits = m(torch.tensor([p + a[:i]])).logits[0, -1]
            out.append(float(torch.log_softmax(logits, -1)[tok]))
        return out

    want = [x for p, a in zip(prompts, ref) for x in ll(model, p, a)]
    assert res.ll_trained == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert res.ll_drop == pytest.approx(res.ll_original - res.ll_trained) and res.ll_drop > 0  # seeded: a real drop
    qs = [Question(i, c, ("q",)) for i, c in enumerate(["a", "a", "a", "b", "c", "c"])]
    assert [q.question_id for q in spread_over_categories(qs, 4)] == [0, 3, 4, 1]
