"""``medusa-bench serve``: the runtime behind an OpenAI-compatible chat endpoint (what it runs: bench.stages.serve)."""

from __future__ import annotations

from bench.commands import flags
from bench.stages.jobs import LoadJob, ServeJob


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the model (with Medusa heads) as an OpenAI-compatible chat endpoint")
    flags.add_model_args(p)
    flags.add_heads(p, "none: plain decoding")
    flags.add_tree(p, role="none: plain decoding on the base the heads decode with (their adapter merged)")
    flags.add_lookup(p, "a chain laid beside the heads' tree")
    p.add_argument("--gate", type=float,
                   help="confidence gate on the tree's levels (0: off; a search's pick may carry one)")
    p.add_argument("--schedule", metavar="TREE_JSON",
                   help="a tree.json with a schedule (search --batch-sizes): each step runs the configuration of its "
                        "range of batch sizes (instead of --tree, --lookup and --gate)")
    p.add_argument("--name", help="the model id clients send (default: --model)")
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="0: any free port (printed)")
    flags.add_new_tokens(p, f"{flags.NEW_TOKENS}; a request's max_tokens may ask for fewer; as a judge, 1024 or more")
    p.add_argument("--max-batch", type=int, help="requests decoded together at most (continuous batching)")
    p.add_argument("--max-queue", type=int, help="requests waiting for a row at most; beyond, the server answers 503")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request but /health "
                   "(default: the MEDUSA_API_KEY environment variable, else none)")
    flags.deprecated(p, "--max-tokens", "--max-new-tokens", "max_new_tokens", type=int)
    p.set_defaults(func="bench.stages.serve:cmd_serve", **ServeJob.defaults())


def add_load(sub) -> None:
    p = sub.add_parser("load", help="the bench under concurrency: the questions' first turns through the runtime's "
                                    "server (plain and Medusa) and llama-server at fixed concurrencies (load.json)")
    flags.add_model_args(p)
    flags.add_heads(p)
    flags.add_tree(p, many=True, role="each served beside plain decoding")
    flags.add_lookup(p, "a chain laid beside each tree")
    p.add_argument("--config", help="serve the greedy Medusa configurations of this replay configuration file "
                                    "(tree, lookup chain, gate) instead of --tree")
    p.add_argument("--schedule", metavar="TREE_JSON",
                   help="also a server that follows this tree.json's schedule (search --batch-sizes): its rows are "
                        "named 'schedule' and carry the search's predicted throughput")
    p.add_argument("--concurrency", type=int, nargs="+", metavar="N", help="clients at once (default 1 2 4 8 16)")
    p.add_argument("--rounds", type=int, metavar="N",
                   help="measure the servers (the runtime's, and vLLM's) N times at each concurrency, each round all in turn "
                        "(the order rotated), and pool the rounds' requests into one row per server (default 1): "
                        "the machine's speed drifts within a run, and rounds spread each row over it")
    p.add_argument("--rate", type=float, nargs="+", metavar="R",
                   help="also Poisson arrivals at these request rates (per second), the runtime's servers")
    p.add_argument("--questions", help="question set: mt-bench (default), humaneval, or a JSONL")
    flags.add_limit(p, "first turns replayed, spread over the categories (default 16)")
    flags.add_new_tokens(p)
    p.add_argument("--engines", type=lambda s: tuple(x for x in s.split(",") if x), metavar="LIST",
                   help="engines measured beside the runtime, comma-separated: llama.cpp (llama-server on the bf16 "
                        "GGUF, as many slots as clients; built into the cache on first use), vllm (its OpenAI server "
                        "on the same weights; the Python of its environment in MEDUSA_VLLM_PYTHON)")
    p.add_argument("--out", help="load.json's path (default results/bench/load.json)")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.load:cmd_load", **LoadJob.defaults())
