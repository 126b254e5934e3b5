"""``medusa-bench serve``: the runtime behind an OpenAI-compatible chat endpoint (medusa_runtime.openai_server)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_parser(sub, add_model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("serve", help="serve the model (with Medusa heads) as an OpenAI-compatible chat endpoint")
    add_model_args(p)
    p.add_argument("--heads", default="default", help="heads folder (either format), default, medusa1, or none "
                                                      "(plain decoding)")
    p.add_argument("--tree", default="chain:2", help="the heads' tree: preset, chain:N or a tree JSON (a search's pick)")
    p.add_argument("--lookup", type=int, default=0, help="prompt-lookup draft tokens beside the tree (0: none)")
    p.add_argument("--gate", type=float, default=0.0,
                   help="confidence gate on the tree's levels (0: off; a search's pick may carry one)")
    p.add_argument("--name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--max-tokens", type=int, default=1024, help="the default and ceiling of a request's max_tokens")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from bench.commands.common import _model_and_heads
    from medusa_runtime.openai_server import ChatService, ServeConfig, make_server
    from treesearch.tree import load_tree

    cfg = ServeConfig(args.name or args.model, args.host, args.port, args.max_tokens,
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
