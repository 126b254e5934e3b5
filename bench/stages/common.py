"""What every stage shares: printing a result (text or --json), logging, and loading the base model and heads
that a job (or a command's flags) names (a Medusa-2 head set's adapter merged into its base)."""

from __future__ import annotations

import argparse
import json
import sys

from medusa_runtime.prompts import BUILTIN_NAMES
from medusa_runtime.prompts import builtin_split as split


def emit(args: argparse.Namespace, obj: dict, text: str | None = None) -> None:
    """A command's result on stdout: one JSON object with --json, else the human text (files written and
    plots are in the object; progress and logs go to stderr either way)."""
    if getattr(args, "json", False):
        print(json.dumps(obj, default=str))
    elif text is not None:
        print(text)


def weights_of(args) -> str:
    """--weights of a command or job that has it (dense, the weights in --dtype, for one that has not)."""
    return getattr(args, "weights", "dense")


def dense_only(args, what: str) -> None:
    """Refuse --weights q4_1 for a command whose model runs on PyTorch's weights (training, sampling prompts)."""
    if weights_of(args) != "dense":
        raise ValueError(f"--weights {weights_of(args)}: {what} runs on the model's dense weights; drop --weights")


def model_and_heads(args):
    """The base model and the heads (``None`` for ``--heads none``) that a command's flags (or job) name."""
    from medusa_runtime.heads.medusa import resolve_heads  # torch: the search stage prints through this module
    from medusa_runtime.model import load_model  # torch: the search stage prints through this module

    loaded = adapted(load_model(args.model, args.dtype, args.device, log=log, weights=weights_of(args)), args.heads)
    return loaded, resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, base_model=args.model)


def show(args: argparse.Namespace, run, job) -> int:
    """A command that runs a stage: the stage's (result object, text) printed as ``emit`` prints."""
    obj, text = run(job)
    emit(args, obj, text)
    return 0


def base_name(model: str) -> str:
    """The model a recorded name was loaded from: ``<model>+adapter:<digest>`` names it with its heads' adapter
    merged (``adapted`` merges it again from the heads)."""
    return model.split("+adapter:", 1)[0]


def adapted(loaded, heads_spec: str | None):
    """The base with the adapter that the named heads were trained with merged in (Medusa-2 heads), else as
    it is; its name then says so (``<model>+adapter:<digest>``), and so does every record made with it."""
    from medusa_runtime.heads.adapter import apply_heads_adapter  # torch: the search stage prints through this module
    from medusa_runtime.heads.medusa import heads_folder  # torch: the search stage prints through this module

    folder = heads_folder(heads_spec)
    return loaded if folder is None else apply_heads_adapter(loaded, folder, log=log)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def builtin_split(prompts, source: str, part: str):
    """The ``train`` or ``calibration`` part of the built-in prompts; other sources are used whole."""
    return split(prompts, part) if source in BUILTIN_NAMES else prompts
