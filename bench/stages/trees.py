"""What the export commands run (their parsers: bench.commands.trees): export (tree strings and configs for serving
engines) and export-heads (head checkpoints in an engine's format). The search is bench.stages.search."""

from __future__ import annotations

import argparse
import json

import torch

from bench.stages.common import adapted, emit, log
from bench.stages.deploy import export
from medusa_runtime.heads import export as serving
from medusa_runtime.heads.medusa import resolve_heads
from medusa_runtime.model import load_model
from treesearch.export import export_tree
from treesearch.tree import load_tree


def write_dtype(dtype: str) -> str:
    """--dtype of what an export writes: auto is bfloat16, the dtype the engines serve the model in."""
    return "bfloat16" if dtype == "auto" else dtype


def cmd_export(args: argparse.Namespace) -> int:
    if args.target is not None:
        return _export_target(args)
    if args.out is not None:
        raise ValueError("--out writes a deployment: name its --target (own, vllm, trtllm, tgi)")
    print(export_tree(load_tree(args.tree), args.format, num_heads=args.num_heads, max_draft_len=args.max_draft_len,
                      model=args.draft_model))
    return 0


def _export_target(args: argparse.Namespace) -> int:
    if args.out is None:
        raise ValueError(f"--target {args.target} writes a folder: name it with --out DIR")
    res = export(args.tree, args.target, args.out, model=args.model, dtype=write_dtype(args.dtype), base_model=args.base_model,
                 log=log)
    lines = [f"written: {res['out']} (for {args.target})"] + [f"note: {n}" for n in res.get("notes", [])]
    if "speculative_config" in res and args.target == "vllm":
        lines.append(f"speculative config ({res['out']}/speculative_config.json): "
                     f"{json.dumps(res['speculative_config'])}")
    lines.append(f"serve it:\n  {res['command']}")
    emit(args, res, "\n".join(lines))
    return 0


def cmd_export_heads(args: argparse.Namespace) -> int:
    loaded = load_model(args.model, "float32", "cpu", log=log)
    heads = resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, args.model)
    if heads is None:
        raise ValueError("--heads none: there are no heads to export")
    if engine_refused := serving.engine_refusal(heads, "vLLM" if args.format == "vllm" else "TGI"):
        raise ValueError(engine_refused)  # before merging an adapter and writing a base for nothing
    merged = adapted(loaded, args.heads)
    base = merged if merged is not loaded else None  # Medusa-2 heads: the engine must serve the adapted base
    lm = merged.model.get_output_embeddings().weight
    dtype = getattr(torch, write_dtype(args.dtype))
    base_line = (f"the adapted base (Medusa-2 heads): {args.out}/{serving.BASE_DIR}" if base is not None
                 else "the base: BASE_MODEL, the model the heads were trained on")
    if args.format == "vllm":
        notes: list[str] = []
        out = serving.export_vllm(heads, lm, args.out, args.num_speculative_tokens, dtype, base=base, warn=notes.append)
        spec = json.loads((out / serving.VLLM_SPEC_FILE).read_text())
        model = f"{out.resolve()}/{serving.BASE_DIR}" if base is not None else "BASE_MODEL"
        text = (f"written: {out} (vLLM Medusa model folder: config.json, model.safetensors); {base_line}\n"
                + "".join(f"note: {n}\n" for n in notes) + f"vLLM's Medusa drafts the heads' top-1 chain ({spec['num_speculative_tokens']} tokens per step), "
                f"not a tree:\n  vllm serve {model} --speculative-config '{json.dumps(spec)}'")
        emit(args, {"out": str(out), "speculative_config": spec, "base": None if base is None else model,
                       "notes": notes}, text)
        return 0
    k = args.num_speculative_tokens or heads.num_heads
    if not 1 <= k <= heads.num_heads:  # TGI refuses --speculate above medusa_num_heads
        raise ValueError(f"TGI drafts one token per head: --num-speculative-tokens must be 1..{heads.num_heads}, got {k}")
    notes: list[str] = []
    base_model = args.base_model or (str(loaded.model.config._name_or_path) if args.model == "default" else args.model)
    out = serving.export_tgi(heads, lm, args.out, base_model, dtype, warn=notes.append, base=base)
    cfg = json.loads((out / "config.json").read_text())
    text = (f"written: {out} (TGI Medusa folder, layout {serving.tgi_layout(heads).upper()}: config.json, "
            f"{serving.TGI_WEIGHTS}); base: {cfg['base_model_name_or_path']}\n" + "".join(f"note: {n}\n" for n in notes)
            + f"TGI drafts the heads' top-1 chain ({k} tokens per step), not a tree:\n"
            f"  text-generation-launcher --model-id {out.resolve()} --speculate {k}")
    emit(args, {"out": str(out), "layout": serving.tgi_layout(heads), "config": cfg, "notes": notes}, text)
    return 0
