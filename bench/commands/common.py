"""What every command shares: printing a result (text or --json), logging, the model flags, and loading the
base model and heads that a command's flags name (a Medusa-2 head set's adapter merged into its base)."""

from __future__ import annotations

import argparse
import json
import sys


def _result(args: argparse.Namespace, obj: dict, text: str | None = None) -> None:
    """A command's result on stdout: one JSON object with --json, else the human text (files written and
    plots are in the object; progress and logs go to stderr either way)."""
    if getattr(args, "json", False):
        print(json.dumps(obj, default=str))
    elif text is not None:
        print(text)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from bench.jobs import ModelJob

    p.add_argument("--model", default=ModelJob.model,
                   help="'default' (offline SmolLM2-135M-Instruct), 'gemma3-270m' (offline Gemma 3 270M), a folder or a hub id")
    p.add_argument("--dtype", default=ModelJob.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float16 on CUDA, bfloat16 on a CPU with AVX-512 BF16, else float32 (printed)")
    p.add_argument("--device", default=ModelJob.device, help="cpu, cuda, cuda:1 ... (auto: cuda when present)")


def _model_and_heads(args):
    """The base model and the heads (``None`` for ``--heads none``) that a command's flags (or job) name."""
    from medusa_runtime.heads import resolve_heads
    from medusa_runtime.model import load_model

    loaded = _adapted(load_model(args.model, args.dtype, args.device, log=_log), args.heads)
    return loaded, resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, base_model=args.model)


def show(args: argparse.Namespace, run, job) -> int:
    """A command that runs a stage: the stage's (result object, text) printed as ``_result`` prints."""
    obj, text = run(job)
    _result(args, obj, text)
    return 0


def _base_name(model: str) -> str:
    """The model a recorded name was loaded from: ``<model>+adapter:<digest>`` names it with its heads' adapter
    merged (``_adapted`` merges it again from the heads)."""
    return model.split("+adapter:", 1)[0]


def _adapted(loaded, heads_spec: str | None):
    """The base with the adapter that the named heads were trained with merged in (Medusa-2 heads), else as
    it is; its name then says so (``<model>+adapter:<digest>``), and so does every record made with it."""
    from medusa_runtime.adapter import apply_heads_adapter
    from medusa_runtime.heads import heads_folder

    folder = heads_folder(heads_spec)
    return loaded if folder is None else apply_heads_adapter(loaded, folder, log=_log)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def builtin_split(prompts, source: str, part: str):
    """The ``train`` or ``calibration`` part of the built-in prompts; other sources are used whole."""
    from medusa_runtime.prompts import BUILTIN_NAMES
    from medusa_runtime.prompts import builtin_split as split

    return split(prompts, part) if source in BUILTIN_NAMES else prompts
