"""The values the command line and the stages share: each concept's default (model, heads, tree, lookup, dtype,
device, new tokens, judge) and how a flag's value resolves. ``bench.commands.flags`` adds the flags; the jobs
(``bench.stages.jobs``) and the pipeline name these defaults."""

from __future__ import annotations

MODEL = "default"
HEADS = "auto"  # the shipped heads on the default model, none on any other (medusa_runtime.heads.medusa.auto_heads)
TREE = "chain:2"  # the preset the shipped heads run fastest of (docs/results.md: 1.35x plain on a CPU)
LOOKUP = 4  # prompt-lookup draft tokens beside the heads' tree; 0: off
DTYPE = "auto"
DEVICE = "auto"
MAX_NEW_TOKENS = None  # auto: NEW_TOKENS, or the --profile's where the command has one
NEW_TOKENS = 128
JUDGE = "none"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def adopt_gguf(path: str | None, model: str, log) -> None:
    """``--gguf PATH`` for a packaged ``model``: the file checked and copied into the cache (nothing without it)."""
    if path is None:
        return
    from medusa_runtime import model as models  # torch: only a command given --gguf loads it

    if model not in models.PACKAGED_MODELS:
        raise models.ModelError(f"--gguf takes the GGUF of a packaged model ({', '.join(models.PACKAGED_MODELS)}), "
                                f"not {model!r}")
    models.adopt_gguf(path, models.PACKAGED_MODELS[model], log=log)


def new_tokens(value: int | None, auto: int = NEW_TOKENS) -> int:
    """--max-new-tokens resolved: ``auto`` when unset; at least 1."""
    n = auto if value is None else value
    if n < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {n}")
    return n


def judge_name(value: str) -> str:
    """A --judge value as the judge stage reads it: ``local:`` alone is the local default model."""
    return "local:default" if value == "local:" else value


def judge_spec(backend: str | None, model: str | None, local: str | None) -> str:
    """The --judge value of the old --backend / --judge-model / --judge-local flags."""
    if backend in (None, "none"):
        return JUDGE
    return f"local:{local or 'default'}" if backend == "local" else (model or "gpt-4")
