"""Commands that replay questions: speed, replay, judge (what each runs: bench.stages.replay)."""

from __future__ import annotations

import argparse

from bench.commands import flags
from bench.stages.jobs import JudgeJob, ReplayJob, SpeedJob


def add_speed(sub) -> None:
    p = sub.add_parser("speed", help="tokens/s of generate, plain, prompt lookup and Medusa trees, interleaved")
    flags.add_model_args(p)
    flags.add_heads(p)
    flags.add_tree(p, many=True, role="each timed")
    p.add_argument("--hf-engine", action="store_true",
                   help="also time plain decoding on transformers' forward (engine 'hf')")
    p.add_argument("--torch-path", action="store_true",
                   help="also time plain decoding on the lean engine's PyTorch path (engine 'lean-torch')")
    flags.add_lookup(p, "also time the runtime's chain of N, alone and beside each tree")
    p.add_argument("--gate", type=float, nargs="+",
                   help="also time each tree with these confidence gates (with the lookup chain when given)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="time only these configurations (names as in the table; generate and plain always)")
    _add_questions(p)
    p.set_defaults(func="bench.stages.replay:cmd_speed", **SpeedJob.defaults())


def add_replay(sub) -> None:
    p = sub.add_parser("replay", help="replay MT-Bench for a matrix of configurations (resumable records)")
    flags.add_model_args(p)
    flags.add_heads(p)
    p.add_argument("--config", required=True, help="YAML or JSON file with the configurations")
    p.add_argument("--profile-like", metavar="LATENCY",
                   help="profile this latency file's grid again during the replay, in rounds between "
                        "questions (latency-during.json): predictions priced at the replay's own speed")
    p.add_argument("--profile-every", type=int, metavar="N",
                   help="with --profile-like: one round before every N-th question (default 2)")
    flags.add_storage(p, None, ReplayJob.study, "share the matrix among workers on several machines (one "
                                                "question a unit, each claimed once)")
    p.add_argument("--machine",
                   help="with --storage: this machine's name in the records (default: the host name)")
    p.add_argument("--heartbeat", type=int, help="with --storage: seconds between heartbeats")
    p.add_argument("--grace-period", type=int,
                   help="with --storage: seconds without a heartbeat before a unit goes to another worker")
    _add_questions(p)
    p.set_defaults(func="bench.stages.replay:cmd_replay", **ReplayJob.defaults())


def _add_questions(p: argparse.ArgumentParser) -> None:
    """What speed and replay share: the questions replayed, how, and where the records go."""
    p.add_argument("--questions",
                   help="question set: mt-bench (default), humaneval (both fetched offline), or a JSONL")
    p.add_argument("--categories", nargs="+")
    p.add_argument("--ids", nargs="+", type=int, metavar="ID", help="only these question ids")
    flags.add_limit(p, "at most N questions, spread over categories")
    flags.add_new_tokens(p)
    p.add_argument("--repeats", type=int)
    p.add_argument("--sequential", action="store_true",
                   help="decode each answer whole, one configuration after another (default: the runtime's "
                        "configurations of a question one step each in turn, so drift hits all alike)")
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)


def add_judge(sub) -> None:
    p = sub.add_parser("judge", help="quality of replayed answers: log-likelihood under the base (quality.json) and, "
                                     "with a judge backend, FastChat single grading (judge/)")
    flags.add_model_args(p)
    p.add_argument("--records", required=True, help="records.jsonl from replay")
    p.add_argument("--questions")
    flags.add_judge(p)
    flags.add_old_judge_flags(p)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.replay:cmd_judge", **JudgeJob.defaults())
