"""Commands that measure the runtime on a model: model, draft-vocab, generate, calibrate, validate, profile (what
each runs: bench.stages.measure)."""

from __future__ import annotations

import argparse

from bench.commands import flags
from bench.stages.jobs import CalibrateJob, DraftVocabJob, GenerateJob, ModelInfoJob, ProfileJob, ValidateJob


def add_model(sub) -> None:
    p = sub.add_parser("model", help="prepare and describe a base model (the offline default by default)")
    flags.add_model_args(p)
    flags.add_gguf(p)
    flags.add_heads(p, "the base is described as they decode with it (Medusa-2 heads: their adapter merged)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func="bench.stages.measure:cmd_model", **ModelInfoJob.defaults())


def add_draft_vocab(sub) -> None:
    p = sub.add_parser("draft-vocab", help="copy a heads folder with its draft vocabulary cut to the S most "
                                           "frequent tokens of some replies (a smaller projection per step)")
    flags.add_model_args(p)
    flags.add_heads(p, "the heads to copy")
    p.add_argument("--size", type=int, required=True, help="tokens to keep (S)")
    p.add_argument("--replies", required=True,
                   help="self-distilled replies: an answer store folder (what 'distill' and 'train' write, under the "
                        "model cache's distill/ folder by default) or one JSONL of replies (turns, input_ids, "
                        "reply_start); never the workload you measure on")
    flags.add_limit(p, "read only its first N replies")
    p.add_argument("--max-len", type=int, help="count reply tokens up to this position, as training does")
    p.add_argument("--out", required=True, help="new folder for the copy")
    p.set_defaults(func="bench.stages.measure:cmd_draft_vocab", **DraftVocabJob.defaults())


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with Medusa heads on a candidate tree")
    flags.add_model_args(p)
    flags.add_heads(p, "none: plain decoding")
    flags.add_tree(p)
    flags.add_accept(p)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, help="top-k filter of the target distribution (0: off)")
    p.add_argument("--posterior-threshold", type=float, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, help="typical: delta")
    p.add_argument("--candidates", type=int, help="candidates read from each head's top-k (the tree's "
                                                  "ranks must stay below it); --top-k filters sampling")
    p.add_argument("--seed", type=int)
    flags.add_new_tokens(p)
    p.add_argument("--engine", choices=["auto", "lean", "lean-torch", "lean-static", "hf"],  # engine.ENGINES
                   help="forward engine: lean (Llama family, fast; its C forward in bf16 on AVX-512 BF16 CPUs, CUDA "
                        "graphs on CUDA), lean-torch (the lean engine on eager PyTorch ops), lean-static (the "
                        "fixed-shape steps CUDA graphs capture, run eagerly) or hf (transformers, any model); auto "
                        "picks")
    flags.add_lookup(p, "a chain laid beside the heads' tree (measured to pay on MT-Bench)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func="bench.stages.measure:cmd_generate", **GenerateJob.defaults())


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure head x rank acceptance on greedy rollouts -> acceptance.json")
    flags.add_model_args(p)
    flags.add_heads(p)
    p.add_argument("--data", help="builtin (its calibration split) or a prompt file")
    flags.add_limit(p, "use the first N prompts")
    flags.add_new_tokens(p)
    p.add_argument("--candidates", type=int, help="ranks recorded per head (at most 36)")
    p.add_argument("--heldout", type=float, help="share of prompts held out")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--typical-temperature", type=float,
                   help="also store what typical acceptance at this temperature needs (search --accept typical)")
    p.add_argument("--rollouts", choices=["runtime", "generate"],
                   help="greedy text to calibrate on: the runtime's own plain decoding (what its greedy configurations "
                        "decode, token for token) or transformers' batched generate (faster)")
    p.add_argument("--out")
    p.add_argument("--plots", help="folder for the heatmap")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.measure:cmd_calibrate", **CalibrateJob.defaults())


def add_validate(sub) -> None:
    p = sub.add_parser("validate", help="replay-predicted tau vs measured tau on held-out calibration prompts")
    p.add_argument("--acceptance", required=True)
    flags.add_tree(p, many=True, role="each replayed and decoded")
    flags.deprecated(p, "--trees", "--tree", "tree", nargs="+")
    flags.add_model(p, default=None, help="default: the model the statistics name")
    flags.add_heads(p, "here auto: the heads the statistics name")
    flags.add_dtype(p, help="auto: the dtype the statistics were measured in")
    flags.add_device(p)
    flags.add_accept(p, ("greedy", "typical"),
                     "typical: sample at the calibration's typical temperature and replay typical acceptance")
    p.add_argument("--posterior-threshold", type=float, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, help="typical: delta")
    p.add_argument("--seed", type=int, help="sampling seed (typical)")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.measure:cmd_validate", **ValidateJob.defaults())


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure verify time vs tree nodes on this machine -> latency.json")
    flags.add_model_args(p)
    flags.add_heads(p)
    p.add_argument("--nodes", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--prefill", type=int, nargs="+",
                   help="prompt lengths whose prefill is timed (default: the contexts)")
    p.add_argument("--repeats", type=int)
    flags.add_batch_sizes(p, "also time whole batched steps of this many requests by tree size (what a schedule is "
                             "priced with)")
    p.add_argument("--serving", action=argparse.BooleanOptionalAction,
                   help="with --batch-sizes: also measure what serving adds to a step (waking the server and its "
                        "client, a streamed chunk per request), by serving plain decoding at each batch size beside "
                        "the same requests decoded in-process (default: on)")
    flags.add_new_tokens(p)
    p.add_argument("--out")
    p.add_argument("--plots")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.measure:cmd_profile", **ProfileJob.defaults())
