"""Medusa-2 on the top layers (medusa_runtime/training/medusa2.py): the cached-prefix student against the full
forward, the distillation loss against a direct computation, training and resume, the adapter that ships
beside the heads (merged at load, refused when missing or for another base), and exact decoding on it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import adapter
from medusa_runtime.heads.medusa import HeadsError, load_heads
from medusa_runtime.model import LoadedModel
from medusa_runtime.training import medusa2
from medusa_runtime.training.train import TrainConfig, head_targets, ids_and_labels

from .conftest import hf_greedy, tiny_llama


def _cfg(**kw) -> TrainConfig:
    base = dict(method="medusa2", num_heads=2, epochs=2, batch_tokens=512, val_fraction=0.2, lora_rank=4,
                train_layers=1, heads_warmup_ratio=0.25, lr=1e-2, base_lr=5e-3, lm_weight=0.0, checkpoint_every=3)
    return TrainConfig(**{**base, **kw})


def test_top_layers_on_cached_inputs_equal_the_full_forward(tiny_examples, monkeypatch, tmp_path):
    """The residual stream entering layer N - L, cached, through the (not yet trained) adapted top layers
    gives the model's own last hidden state; the cache is reused on a second call."""
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path))
    loaded, _, examples, _ = tiny_examples
    peft_model, layers = medusa2.lora_student(loaded, 1, 4)
    assert layers == (1,)
    top = medusa2.TopLayers(peft_model, layers[0])
    prefix, last = medusa2.layer_states(loaded, examples[:5], 768, layers[0], progress=False, log=lambda m: None)
    with torch.no_grad():
        for ex, p, t in zip(examples[:5], prefix, last):
            want = loaded.model(torch.tensor([ex.input_ids]), output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(top(p.float()), want, atol=0.02, rtol=0.02)  # the cache keeps bf16
            torch.testing.assert_close(t.float(), want, atol=0.02, rtol=0.02)
    said = []
    again = medusa2.layer_states(loaded, examples[:5], 768, layers[0], progress=False, log=said.append)
    assert "reloaded" in said[0] and all(torch.equal(a, b) for a, b in zip(again[0], prefix))
    # the last hidden states are where Medusa-1 training keeps them: either trainer reuses the other's
    from medusa_runtime.training.train import base_hidden_states

    said.clear()
    m1 = base_hidden_states(loaded, examples[:5], 768, progress=False, log=said.append)
    assert "reloaded" in said[0] and all(torch.equal(a, b) for a, b in zip(m1, last))


def test_distill_loss_is_the_kl_of_the_two_next_token_distributions():
    gen = torch.Generator().manual_seed(0)
    lm = torch.randn(50, 8, generator=gen)
    t, s = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    p, q = F.softmax(t @ lm.T, -1), F.softmax(s @ lm.T, -1)
    want = (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(medusa2.distill_loss(s, t, lm), want)
    assert float(medusa2.distill_loss(t, t, lm)) == pytest.approx(0.0, abs=1e-6)


def _train(loaded, examples, cfg, out, **kw):
    return medusa2.train_medusa2_top(loaded, examples, cfg, out, progress=False, log=lambda m: None, **kw)


def test_trained_adapter_merges_into_the_base_and_decoding_stays_exact(tiny_examples, tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    loaded, _, examples, _ = tiny_examples
    res = _train(loaded, examples[:20], _cfg(), tmp_path / "run")
    assert any(not h["joint"] for h in res.history) and any(h["joint"] for h in res.history)
    record = json.loads((tmp_path / "run" / "training.json").read_text())
    assert record["drift"]["tokens"] > 0 and record["drift"]["kl_per_token"] > 0  # the base moved
    folder = tmp_path / "run" / "heads"
    assert (folder / "adapter" / "adapter_config.json").is_file()
    info = adapter.adapter_info(folder)
    assert info.layers == (1,) and info.base_model == loaded.name
    adapted = adapter.apply_heads_adapter(loaded, folder, log=lambda m: None)
    assert adapted.name.startswith(loaded.name + "+adapter:")
    changed = [n for n, p in adapted.model.named_parameters()
               if not torch.equal(p, dict(loaded.model.named_parameters())[n])]
    assert changed and all(n.startswith("model.layers.1.") for n in changed)  # the top layer only
    # merged base = the original's bottom layers, then the trained top layers on their output
    import copy

    import peft

    with adapter.quiet_peft():
        student = peft.PeftModel.from_pretrained(copy.deepcopy(loaded.model), str(info.path))
    top = medusa2.TopLayers(student, 1)
    ex = examples[0]
    with torch.no_grad():
        hs = loaded.model(torch.tensor([ex.input_ids]), output_hidden_states=True).hidden_states
        want = adapted.model(torch.tensor([ex.input_ids]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(top(hs[1][0]), want, atol=1e-4, rtol=1e-4)
    # greedy Medusa decoding on the adapted base is the adapted base's own greedy decoding
    heads = load_heads(folder, loaded.hidden_size, loaded.vocab_size)
    prompt = list(ex.input_ids[: ex.reply_start])
    out = MedusaDecoder(adapted, heads, "chain:2", config=DecodeConfig(max_new_tokens=20)).generate(prompt)
    assert out.token_ids == hf_greedy(adapted, prompt, 20)
    # the original model is untouched
    assert all(not p.requires_grad for p in loaded.model.parameters())


def test_adapter_refused_when_missing_or_for_another_base(tiny_examples, tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    loaded, _, examples, _ = tiny_examples
    _train(loaded, examples[:12], _cfg(epochs=1), tmp_path / "run")
    folder = tmp_path / "run" / "heads"
    other = tiny_llama(vocab=loaded.vocab_size, seed=11)
    other = LoadedModel(other.model, loaded.tokenizer, "tiny-other", torch.float32, torch.device("cpu"))
    with pytest.raises(HeadsError, match="trained on another base"):
        adapter.apply_heads_adapter(other, folder, log=lambda m: None)
    shutil.rmtree(folder / "adapter")
    with pytest.raises(HeadsError, match="need the base adapter .* which is missing"):
        adapter.apply_heads_adapter(loaded, folder, log=lambda m: None)
    plain = tmp_path / "plain"  # heads without an adapter leave the base as it is
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    assert adapter.apply_heads_adapter(loaded, plain) is loaded


def test_interrupted_run_resumes_to_the_uninterrupted_result(tiny_examples, tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    loaded, _, examples, _ = tiny_examples
    cfg = _cfg(val_fraction=0.0)
    whole = _train(loaded, examples[:20], cfg, tmp_path / "whole")
    assert whole.steps > cfg.checkpoint_every + 2
    real, calls = medusa2.joint_loss, []

    def interrupting(*a, **kw):
        calls.append(1)
        if len(calls) == cfg.checkpoint_every + 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(medusa2, "joint_loss", interrupting)
        with pytest.raises(KeyboardInterrupt):
            _train(loaded, examples[:20], cfg, tmp_path / "cut")
    resumed = _train(loaded, examples[:20], cfg, tmp_path / "cut", resume=True)
    assert resumed.steps == whole.steps and resumed.history == whole.history
    for part in ("medusa_lm_head.safetensors", "adapter/adapter_model.safetensors"):
        from safetensors.torch import load_file

        a, b = (load_file(tmp_path / run / "heads" / part) for run in ("whole", "cut"))
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), part


def test_drift_is_zero_for_the_untrained_adapter(tiny_examples, tmp_path, monkeypatch):
    """LoRA starts as the identity: the adapted base is the original (KL 0, no log-likelihood drop)."""
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path))
    loaded, _, examples, _ = tiny_examples
    peft_model, layers = medusa2.lora_student(loaded, 2, 4)
    top = medusa2.TopLayers(peft_model, layers[0])
    prefix, last = medusa2.layer_states(loaded, examples[:4], 768, layers[0], progress=False, log=lambda m: None)
    _, labels = ids_and_labels(examples[:4], 768)
    d = medusa2.drift(top, prefix, last, labels, loaded.model.get_output_embeddings().weight.detach())
    assert d["tokens"] == sum(int(head_targets(lab[None], 1)[0].sum()) for lab in labels)
    assert abs(d["kl_per_token"]) < 1e-3 and abs(d["ll_drop_per_token"]) < 1e-2


@pytest.mark.parametrize("engine", ["vllm", "tgi"])
def test_engine_exports_carry_the_adapted_base(tiny_examples, tmp_path, monkeypatch, engine):
    """Medusa-2 heads decode on the base with their adapter merged: an export for an engine writes that
    base as a transformers folder (``base/``) the engine loads, equal to the adapted base, and a TGI
    config names it as the base."""
    from transformers import AutoModelForCausalLM

    from medusa_runtime.heads import export as serving

    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    loaded, _, examples, _ = tiny_examples
    _train(loaded, examples[:12], _cfg(epochs=1), tmp_path / "run")
    folder = tmp_path / "run" / "heads"
    adapted = adapter.apply_heads_adapter(loaded, folder, log=lambda m: None)
    heads = load_heads(folder, loaded.hidden_size, loaded.vocab_size)
    lm = adapted.model.get_output_embeddings().weight
    out = tmp_path / engine
    if engine == "vllm":
        serving.export_vllm(heads, lm, out, dtype=torch.float32, base=adapted)
    else:
        serving.export_tgi(heads, lm, out, "ignored", dtype=torch.float32, base=adapted)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["base_model_name_or_path"] == str((out / serving.BASE_DIR).resolve())
    reloaded = AutoModelForCausalLM.from_pretrained(str(out / serving.BASE_DIR)).eval()
    ids = torch.tensor([examples[0].input_ids])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, adapted.model(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(reloaded(ids).logits, loaded.model(ids).logits, atol=1e-4)  # not the original


def test_shipped_adapter_loads_in_float16_as_in_float32_and_bfloat16():
    """The base digest is taken from the checkpoint's stored values, so the shipped Medusa-2 heads accept the
    default model loaded in any dtype: a float16 load rounds some weights otherwise than a bf16 rounding of
    the stored float32 values would (its digest from the loaded values differs, which the shipped heads
    used to refuse), and decoding with the float16 base runs."""
    from medusa_runtime.heads.medusa import shipped_heads_dir
    from medusa_runtime.model import load_model

    folder = shipped_heads_dir("default")
    info = adapter.adapter_info(folder)
    names = []
    for dtype in ("float32", "bfloat16", "float16"):
        loaded = load_model("default", dtype, "cpu", log=lambda m: None)
        assert adapter.base_digest(loaded.model, info.layers) == info.base_digest
        names.append(adapter.apply_heads_adapter(loaded, folder, log=lambda m: None).name)
    assert len(set(names)) == 1 and names[0].endswith(f"+adapter:{info.base_digest[:8]}")
    # what the loaded float16 values alone would give: another digest (the refusal the stored values avoid)
    half = load_model("default", "float16", "cpu", log=lambda m: None).model
    layers = adapter.decoder_layers(half)
    h = __import__("hashlib").sha256()
    for i in info.layers:
        for name, p in sorted(layers[i].named_parameters()):
            h.update(name.encode())
            h.update(p.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    assert h.hexdigest() != info.base_digest
