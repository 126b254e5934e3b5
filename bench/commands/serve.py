"""``medusa-bench serve``: the runtime behind an OpenAI-compatible chat endpoint (what it runs: bench.stages.serve)."""

from __future__ import annotations

from bench.commands import flags
from bench.stages.jobs import ServeJob


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the model (with Medusa heads) as an OpenAI-compatible chat endpoint")
    flags.add_model_args(p)
    flags.add_heads(p, "none: plain decoding")
    flags.add_tree(p)
    flags.add_lookup(p, "a chain laid beside the heads' tree")
    p.add_argument("--gate", type=float,
                   help="confidence gate on the tree's levels (0: off; a search's pick may carry one)")
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
