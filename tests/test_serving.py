"""Exports for serving engines, checked against the engines' own formats.

vLLM: the Medusa draft model ``vllm/model_executor/models/medusa.py`` (parameters ``blocks.{i}.layers.{j}``
as ``nn.Linear(H, H, bias=config.medusa_fc_bias)``, ``lm_heads.{i}`` or, with ``original_lm_head``, one
``lm_head`` loaded from ``lm_heads.0.weight``; ``token_map`` when ``truncated_vocab_size < vocab_size``, which
vLLM 0.32's loader refuses, so the export writes the whole vocabulary)
and its config ``vllm/transformers_utils/configs/medusa.py`` (keys holding "num" and "heads"/"layers"
renamed to ``num_heads`` / ``num_hidden_layers``). TensorRT-LLM: ``--medusa_choices`` read with
``ast.literal_eval`` (examples/medusa/run.py) and ``MedusaDecodingConfig`` (tensorrt_llm/llmapi/llm_args.py:
``decoding_type``, ``max_draft_len``, ``num_medusa_heads``, ``medusa_choices``). TGI:
``server/text_generation_server/models/__init__.py`` (``medusa_num_heads`` in config.json marks a Medusa
folder for ``base_model_name_or_path``, weights ``medusa_lm_head.safetensors``),
``layers/speculative.py`` (an ``architectures`` entry means another speculator; else MedusaHeadV1, and on
any failure MedusaHeadV2) and ``layers/medusa.py`` (V1: ``{i}.{j}.linear`` residual blocks and ``{i}.{L}``
projection per head; V2: ``medusa_num_layers == 1`` asserted, ``{i}.0.linear``, the base lm_head).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from medusa_runtime.heads.export import TGI_WEIGHTS, VLLM_SPEC_FILE, VLLM_WEIGHTS, export_tgi, export_vllm
from medusa_runtime.heads.medusa import HeadsConfig, HeadsError, MedusaHeads, fresh_heads
from treesearch.export import export_tree, to_trtllm_config
from treesearch.tree import TreeError, chain, load_tree, make_tree

from .conftest import tiny_llama

HIDDEN, VOCAB = 64, 64


def _random_heads(shared: bool, draft: list[int] | None, k: int = 3, layers: int = 2, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(HeadsConfig(k, layers, HIDDEN, VOCAB, shared))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    heads.set_draft_vocab(draft)
    return heads


def _vllm_expected_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes vLLM's Medusa module loads, from its config alone."""
    k, layers, h = cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"]
    out: dict[str, tuple[int, ...]] = {}
    for i in range(k):
        for j in range(layers):
            out[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if cfg.get("medusa_fc_bias", False):
                out[f"blocks.{i}.layers.{j}.bias"] = (h,)
    rows = cfg["truncated_vocab_size"]
    heads = [0] if cfg.get("original_lm_head", False) else range(k)  # original_lm_head: lm_heads.0 -> lm_head
    for i in heads:
        out[f"lm_heads.{i}.weight"] = (rows, h)
    if cfg["truncated_vocab_size"] < cfg["vocab_size"]:
        out["token_map"] = (rows,)
    return out


def _vllm_config_parse(raw: dict) -> dict:
    """vLLM's MedusaConfig.from_pretrained key handling."""
    cfg = dict(raw)
    for key in list(cfg):
        if "num" in key:
            if "heads" in key:
                cfg["num_heads"] = cfg.pop(key)
            elif "layers" in key:
                cfg["num_hidden_layers"] = cfg.pop(key)
    cfg.setdefault("truncated_vocab_size", cfg["vocab_size"])
    return cfg


def _vllm_drafts(sd: dict[str, torch.Tensor], cfg: dict, hidden: torch.Tensor) -> list[int]:
    """The top-1 token per head as vLLM's Medusa computes it from the written tensors."""
    out = []
    for i in range(cfg["num_heads"]):
        x = hidden.float()
        for j in range(cfg["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, sd[f"blocks.{i}.layers.{j}.weight"].float(),
                                    sd.get(f"blocks.{i}.layers.{j}.bias", torch.zeros(1)).float()))
        lm = sd["lm_heads.0.weight" if cfg.get("original_lm_head") else f"lm_heads.{i}.weight"].float()
        logits = x @ lm.T
        if "token_map" in sd:
            full = torch.full((cfg["vocab_size"],), float("-inf"))
            full[sd["token_map"]] = logits
            logits = full
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("shared,draft", [(True, None), (True, list(range(0, VOCAB, 3))), (False, None),
                                          (False, list(range(5, 40)))])
def test_vllm_folder_has_what_vllms_loader_reads_and_drafts_our_top1(tmp_path, shared, draft):
    loaded = tiny_llama(vocab=VOCAB)
    heads = _random_heads(shared, draft)
    lm = loaded.model.get_output_embeddings().weight
    out = export_vllm(heads, lm, tmp_path / "vllm", num_tokens=2, dtype=torch.float32)
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "medusa"
    cfg = _vllm_config_parse(raw)
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, HIDDEN, VOCAB)
    sd = load_file(str(out / VLLM_WEIGHTS))
    assert {k: tuple(v.shape) for k, v in sd.items()} == _vllm_expected_params(cfg)
    spec = json.loads((out / VLLM_SPEC_FILE).read_text())
    assert spec == {"method": "medusa", "model": str(out.resolve()), "num_speculative_tokens": 2}
    assert cfg["truncated_vocab_size"] == cfg["vocab_size"] and "token_map" not in sd
    heads.set_draft_vocab(None)  # vLLM scores the whole vocabulary
    torch.manual_seed(1)
    for hidden in torch.randn(8, HIDDEN):
        ours = heads(hidden, loaded.model.get_output_embeddings()).argmax(-1).tolist()  # [K]
        assert _vllm_drafts(sd, cfg, hidden) == ours


def test_conditioned_heads_and_bad_chain_lengths_are_refused(tmp_path):
    loaded = tiny_llama(vocab=VOCAB)
    lm = loaded.model.get_output_embeddings().weight
    for cond in ("root", "path"):
        heads = MedusaHeads(HeadsConfig(2, 1, HIDDEN, VOCAB, True, root_conditioned=True,
                                        path_conditioned=cond == "path"))
        with pytest.raises(HeadsError, match=f"{cond}-conditioned.*vLLM does not implement"):
            export_vllm(heads, lm, tmp_path / cond)
        assert not (tmp_path / cond).exists()
    with pytest.raises(HeadsError, match="num_speculative_tokens must be 1..2"):
        export_vllm(fresh_heads(2, 1, HIDDEN, VOCAB), lm, tmp_path / "x", num_tokens=3)


@pytest.mark.parametrize("fmt", ["vllm", "tgi"])
def test_export_heads_cli_refuses_the_shipped_conditioned_heads_in_one_line(tmp_path, fmt):
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "export-heads", "--format", fmt, "--heads", "default",
                           "--out", str(tmp_path / "v")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("medusa-bench: error: these heads are path-conditioned") and "--condition none" in last
    assert not (tmp_path / "v").exists()


def _tgi_load(folder, lm_weight: torch.Tensor, speculate: int | None = None):
    """TGI's loading path for a Medusa folder, from its source (see the module docstring): returns the
    layout it lands on and its draft function (hidden [H] -> the argmax token of each speculated head)."""
    cfg = json.loads((folder / "config.json").read_text())
    assert "medusa_num_heads" in cfg and cfg["base_model_name_or_path"]  # get_model's test and the base it loads
    assert "architectures" not in cfg  # SpeculativeHead.load: with it, TGI takes the folder for another speculator
    k = cfg["medusa_num_heads"] if speculate is None else speculate
    assert k <= cfg["medusa_num_heads"]  # get_model raises otherwise
    sd = load_file(str(folder / TGI_WEIGHTS))
    layers = cfg["medusa_num_layers"]
    v1 = [f"{i}.{j}.linear.{w}" for i in range(k) for j in range(layers) for w in ("weight", "bias")]
    v1 += [f"{i}.{layers}.weight" for i in range(k)]
    layout = "v1" if all(name in sd for name in v1) else "v2"  # V1.load raises on a missing key -> V2
    if layout == "v2":
        assert layers == 1  # MedusaHeadV2's assert
        assert all(f"{i}.0.linear.{w}" in sd for i in range(k) for w in ("weight", "bias"))

    def drafts(hidden: torch.Tensor) -> list[int]:
        out = []
        for i in range(k):
            x = hidden.float()
            for j in range(layers):  # ResBlock: x + SiLU(linear(x))
                x = x + F.silu(F.linear(x, sd[f"{i}.{j}.linear.weight"].float(), sd[f"{i}.{j}.linear.bias"].float()))
            proj = sd[f"{i}.{layers}.weight"] if layout == "v1" else lm_weight  # V2: the base lm_head
            out.append(int((x @ proj.float().T).argmax()))  # Greedy() over the speculative logits
        return out

    return layout, drafts, cfg


@pytest.mark.parametrize("shared,layers,draft,layout", [(True, 1, None, "v2"), (True, 2, None, "v1"),
                                                        (False, 1, None, "v1"), (True, 1, list(range(0, VOCAB, 2)), "v2")])
def test_tgi_folder_loads_as_tgi_reads_it_and_drafts_our_top1(tmp_path, shared, layers, draft, layout):
    loaded = tiny_llama(vocab=VOCAB)
    lm = loaded.model.get_output_embeddings().weight
    heads = _random_heads(shared, draft, layers=layers)
    notes: list[str] = []
    out = export_tgi(heads, lm, tmp_path / "tgi", "org/base-model", dtype=torch.float32, warn=notes.append)
    got_layout, drafts, cfg = _tgi_load(out, lm)
    assert got_layout == layout and cfg["base_model_name_or_path"] == "org/base-model"
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, layers)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", TGI_WEIGHTS]
    full = _random_heads(shared, None, layers=layers)  # the same weights scoring the whole vocabulary
    assert notes == ([] if draft is None else [notes[0]]) and (draft is None or "whole vocabulary" in notes[0])
    torch.manual_seed(1)
    for hidden in torch.randn(8, HIDDEN):
        assert drafts(hidden) == full(hidden, loaded.model.get_output_embeddings()).argmax(-1).tolist()
        if draft is None:
            assert drafts(hidden) == heads(hidden, loaded.model.get_output_embeddings()).argmax(-1).tolist()
    _, two, _ = _tgi_load(out, lm, speculate=2)  # --speculate 2: the first two heads' chain
    assert two(hidden) == drafts(hidden)[:2]


def test_tgi_refuses_conditioned_heads_and_a_missing_base(tmp_path):
    lm = tiny_llama(vocab=VOCAB).model.get_output_embeddings().weight
    heads = MedusaHeads(HeadsConfig(2, 1, HIDDEN, VOCAB, True, root_conditioned=True, path_conditioned=True))
    with pytest.raises(HeadsError, match="path-conditioned.*TGI does not implement"):
        export_tgi(heads, lm, tmp_path / "c", "org/base")
    with pytest.raises(HeadsError, match="TGI loads the base from the heads' config"):
        export_tgi(fresh_heads(2, 1, HIDDEN, VOCAB), lm, tmp_path / "b", "")
    assert not (tmp_path / "c").exists() and not (tmp_path / "b").exists()


def test_trtllm_choices_and_config_parse_as_the_engine_reads_them():
    tree = load_tree("mc_sim_7b_63")
    arg = export_tree(tree, "trtllm")
    assert arg.startswith("--medusa_choices=")
    assert ast.literal_eval(arg.split("=", 1)[1].strip('"')) == tree.as_lists()
    cfg = yaml.safe_load(to_trtllm_config(tree, num_heads=4))["speculative_config"]
    assert set(cfg) == {"decoding_type", "max_draft_len", "num_medusa_heads", "medusa_choices"}
    assert cfg["decoding_type"] == "Medusa" and cfg["num_medusa_heads"] == 4
    assert cfg["medusa_choices"] == tree.as_lists() and cfg["max_draft_len"] == len(tree.paths) == 63


def test_trtllm_refuses_trees_past_the_draft_limit_or_deeper_than_the_heads():
    tree = load_tree("mc_sim_7b_63")
    with pytest.raises(TreeError, match="63 draft nodes.*max_draft_len=32"):
        export_tree(tree, "trtllm", max_draft_len=32)
    with pytest.raises(TreeError, match="4 levels deep; the engine has 3 Medusa heads"):
        export_tree(tree, "trtllm-config", num_heads=3)
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "export", "--tree", "mc_sim_7b_63", "--format", "trtllm",
                           "--max-draft-len", "16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith("medusa-bench: error: tree 'mc_sim_7b_63' has 63 draft nodes")


def test_vllm_tree_export_is_the_top1_chain_and_says_so():
    notes = []
    from treesearch.export import to_vllm

    assert json.loads(to_vllm(chain(3), warn=notes.append)) == {"method": "medusa", "num_speculative_tokens": 3}
    assert notes == []
    spec = json.loads(to_vllm(make_tree([[0], [1], [0, 0], [0, 1]], name="t"), model="m", warn=notes.append))
    assert spec == {"method": "medusa", "num_speculative_tokens": 2, "model": "m"}
    assert notes and "top-1 chain only" in notes[0]
    with pytest.raises(TreeError, match="no rank-0 chain"):
        to_vllm(make_tree([[1]]))


def test_shipped_unconditioned_heads_export_for_tgi_and_vllm(tmp_path):
    """The shipped set that engines can serve: exported by the command for both engines, read as each engine
    reads it, drafting what the runtime's heads draft (TGI: over the whole vocabulary, which it always scores)."""
    from pathlib import Path

    from bench.cli import main
    from medusa_runtime.heads.medusa import resolve_heads
    from medusa_runtime.model import load_model

    loaded = load_model("default", "float32", log=lambda m: None)
    lm_head = loaded.model.get_output_embeddings()
    heads = resolve_heads("unconditioned", loaded.hidden_size, loaded.vocab_size)
    assert not heads.root_conditioned and heads.config.num_layers == 1 and heads.draft_vocab is not None
    assert main(["export-heads", "--format", "tgi", "--heads", "unconditioned", "--dtype", "float32",
                 "--out", str(tmp_path / "tgi")]) == 0
    layout, tgi_drafts, cfg = _tgi_load(tmp_path / "tgi", lm_head.weight)
    assert layout == "v2" and Path(cfg["base_model_name_or_path"], "config.json").is_file()  # a base TGI can load
    assert main(["export-heads", "--format", "vllm", "--heads", "unconditioned", "--dtype", "float32",
                 "--out", str(tmp_path / "vllm")]) == 0
    vcfg = _vllm_config_parse(json.loads((tmp_path / "vllm" / "config.json").read_text()))
    sd = load_file(str(tmp_path / "vllm" / VLLM_WEIGHTS))
    assert vcfg["truncated_vocab_size"] == vcfg["vocab_size"] == loaded.vocab_size and "token_map" not in sd
    full = resolve_heads("unconditioned", loaded.hidden_size, loaded.vocab_size)
    full.set_draft_vocab(None)
    torch.manual_seed(0)
    with torch.no_grad():
        for hidden in torch.randn(4, loaded.hidden_size) * 2:
            assert _vllm_drafts(sd, vcfg, hidden) == full(hidden, lm_head).argmax(-1).tolist()
            assert tgi_drafts(hidden) == full(hidden, lm_head).argmax(-1).tolist()
