"""What ``medusa-bench serve`` runs (its parser: bench.commands.serve): the runtime behind an OpenAI-compatible chat
endpoint (medusa_runtime.server) under uvicorn."""

from __future__ import annotations

import argparse
import copy
import os
import signal
import socket
import sys
import threading

import uvicorn
import uvicorn.config

from bench.stages import defaults
from bench.stages.common import model_and_heads
from medusa_runtime.server.app import ChatServer, schedule_ranges
from medusa_runtime.server.protocol import ServeConfig
from treesearch.schedule import read_schedule
from treesearch.tree import load_tree


def serve_config(args: argparse.Namespace):
    return ServeConfig(args.name or args.model, args.host, args.port, defaults.new_tokens(args.max_new_tokens),
                       None if args.heads in (None, "none") or args.tree == "none" else args.tree, lookup=args.lookup,
                       gate=args.gate,
                       max_batch=args.max_batch, max_queue=args.max_queue, schedule=args.schedule,
                       api_key=args.api_key or os.environ.get("MEDUSA_API_KEY") or None)


def log_config() -> dict:
    """uvicorn's logging with the access lines on stderr too: stdout carries the one line that says where."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config(args)
    if cfg.schedule is not None:
        # a bad schedule, or one whose ranges draft with heads not given, fails before the model loads
        ranges = read_schedule(cfg.schedule)
        schedule_ranges(ranges, args.heads not in (None, "none"))
        what = "schedule " + ", ".join(f"{e['batch'][0]}-{e['batch'][1]}: {e['configuration']['config']}"
                                       for e in ranges)
    elif cfg.tree is not None:
        load_tree(cfg.tree)  # a bad tree fails before the model loads
        what = "tree " + cfg.tree
    else:
        what = "plain decoding" + (" on the heads' base" if args.heads not in (None, "none") else "")
    loaded, heads = model_and_heads(args)
    server = ChatServer(loaded, heads, cfg)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as exc:
        print(f"error: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}", file=sys.stderr)
        return 2
    sock.listen(2048)  # connections wait in the backlog from now on, until uvicorn takes them
    host, port = sock.getsockname()[:2]
    # the first stdout line says where (a script that asked for port 0 reads it)
    print(f"serving {cfg.name} at http://{host}:{port}/v1 ({what}, "
          f"{str(loaded.dtype).removeprefix('torch.')} on {loaded.device}, batches of {server.max_batch} at most, "
          f"queue {cfg.max_queue})", flush=True)
    serve_beside_decoding(server, uvicorn.Config(server.app(decode_on_own_thread=False), log_config=log_config(),
                                                 timeout_graceful_shutdown=5), sock)
    return 0


def serve_beside_decoding(server: ChatServer, config: uvicorn.Config, sock: socket.socket) -> None:
    """uvicorn on a thread of its own, the decoding loop on this (the main) thread, where its kernels run fastest
    (``Scheduler.run``). SIGINT and SIGTERM ask uvicorn to drain and exit; its lifespan then stops the loop."""
    web = uvicorn.Server(config)

    def serve() -> None:
        try:
            web.run(sockets=[sock])
        finally:
            server.scheduler.stop()  # also when uvicorn fails to start

    def leave(signum, frame) -> None:
        if web.should_exit and signum == signal.SIGINT:
            web.force_exit = True  # a second Ctrl-C drops the open connections
        web.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)
    thread = threading.Thread(target=serve, name="uvicorn", daemon=True)
    thread.start()
    server.scheduler.run()
    thread.join()
