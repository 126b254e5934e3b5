"""What ``medusa-bench serve`` runs (its parser: bench.commands.serve): the runtime behind an OpenAI-compatible chat
endpoint (medusa_runtime.openai_server)."""

from __future__ import annotations

import argparse
import sys

from bench.stages import defaults
from bench.stages.common import model_and_heads
from medusa_runtime.openai_server import ChatService, ServeConfig, make_server
from treesearch.tree import load_tree


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = ServeConfig(args.name or args.model, args.host, args.port, defaults.new_tokens(args.max_new_tokens),
                      None if args.heads in (None, "none") else args.tree, lookup=args.lookup, gate=args.gate)
    if cfg.tree is not None:
        load_tree(cfg.tree)  # a bad tree fails before the model loads
    loaded, heads = model_and_heads(args)
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
