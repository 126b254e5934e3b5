"""``medusa-bench serve``: the runtime behind an OpenAI-compatible chat endpoint (medusa_runtime.openai_server)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bench.commands import flags
from bench.jobs import ServeJob


def add_parser(sub, add_model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("serve", help="serve the model (with Medusa heads) as an OpenAI-compatible chat endpoint")
    add_model_args(p)
    flags.add_heads(p, "none: plain decoding")
    flags.add_tree(p)
    flags.add_lookup(p, "a chain laid beside the heads' tree")
    p.add_argument("--gate", type=float,
                   help="confidence gate on the tree's levels (0: off; a search's pick may carry one)")
    p.add_argument("--name", help="the model id clients send (default: --model)")
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="0: any free port (printed)")
    flags.add_new_tokens(p, f"{flags.NEW_TOKENS}; a request's max_tokens may ask for fewer; as a judge, 1024 or more")
    flags.deprecated(p, "--max-tokens", "--max-new-tokens", "max_new_tokens", type=int)
    p.set_defaults(func=cmd_serve, **ServeJob.defaults())


def cmd_serve(args: argparse.Namespace) -> int:
    from bench.commands.common import _model_and_heads
    from medusa_runtime.openai_server import ChatService, ServeConfig, make_server
    from treesearch.tree import load_tree

    cfg = ServeConfig(args.name or args.model, args.host, args.port, flags.new_tokens(args.max_new_tokens),
                      None if args.heads in (None, "none") else args.tree, lookup=args.lookup, gate=args.gate)
    if cfg.tree is not None:
        load_tree(cfg.tree)  # a bad tree fails before the model loads
    loaded, heads = _model_and_heads(args)
    server = make_server(ChatService(loaded, heads, cfg))
    host, port = server.server_address[:2]
    # the first stdout line says where (a script that asked for port 0 reads it)
    print(f"serving {cfg.name} at http://{host}:{port}/v1 ({'tree ' + cfg.tree if cfg.tree else 'plain decoding'}, "
          f"{str(loaded.dtype).removeprefix('torch.')} on {loaded.device})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
