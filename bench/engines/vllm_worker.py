"""A warm vLLM engine answering one request at a time over a pipe (run by vLLM's own Python, not the project's).

    python vllm_worker.py '{"model": DIR, "dtype": "bfloat16", "speculative_config": {...} | null, ...}'

Protocol, one JSON object a line: the worker writes ``{"ready": true, "startup_s": S, "version": V}`` once the
engine is built, then reads requests ``{"prompt": [token ids], "max_tokens": N}`` from stdin and writes
``{"token_ids": [...], "wall_time": S, "finish_reason": R, "spec": {...} | null}`` for each; ``spec`` holds
vLLM's own speculative-decoding counters for that request (the difference of ``LLM.get_metrics()`` before
and after it): ``drafts``, ``draft_tokens``, ``accepted_tokens`` and ``accepted_per_position``. An error is
``{"error": "one line"}``. vLLM's logging goes to stderr; the protocol keeps the original stdout.

This file imports only vLLM and the standard library, so that it runs in vLLM's own environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics) -> dict:
    """vLLM's speculative counters, summed over label sets (one engine: one set)."""
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POSITION:
            values = [int(v) for v in m.values]
            acc = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(acc + [0] * len(values), values + [0] * len(acc))]
    return out


def delta(before: dict, after: dict) -> dict:
    per = [a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"]) else 0)
           for i, a in enumerate(after["accepted_per_position"])]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")} | {
        "accepted_per_position": per}


def main() -> int:
    # the harness's own modules sit beside this file: never let them shadow vLLM's
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    opts = json.loads(sys.argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stream ...
    os.dup2(2, 1)  # ... and everything vLLM prints to stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    t0 = time.perf_counter()
    try:
        import vllm  # vllm: this file runs in vLLM's own environment
        from vllm import LLM, SamplingParams  # vllm: this file runs in vLLM's own environment
        from vllm.inputs import TokensPrompt  # vllm: this file runs in vLLM's own environment

        llm = LLM(model=opts["model"], tokenizer=opts.get("tokenizer") or opts["model"], dtype=opts["dtype"],
                  max_model_len=opts.get("max_model_len", 2048), enforce_eager=opts.get("enforce_eager", True),
                  enable_prefix_caching=False, disable_log_stats=False, seed=0,
                  max_num_seqs=int(opts.get("max_num_seqs", 1)),
                  speculative_config=opts.get("speculative_config"),
                  kv_cache_memory_bytes=opts.get("kv_cache_memory_bytes"))
    except Exception as exc:  # noqa: BLE001  the one line the harness reports (the traceback goes to the log)
        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
        return 1
    send({"ready": True, "startup_s": time.perf_counter() - t0, "version": vllm.__version__})
    speculative = opts.get("speculative_config") is not None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=False)
            before = spec_counters(llm.get_metrics()) if speculative else None
            t = time.perf_counter()
            prompts = req["prompts"] if "prompts" in req else [req["prompt"]]
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
            wall = time.perf_counter() - t
            spec = delta(before, spec_counters(llm.get_metrics())) if speculative else None
            if "prompts" in req:  # together: one batch
                send({"token_ids": [list(o.outputs[0].token_ids) for o in outs], "wall_time": wall, "spec": spec})
                continue
            first = outs[0].outputs[0]
            send({"token_ids": list(first.token_ids), "wall_time": wall, "finish_reason": first.finish_reason,
                  "spec": spec})
        except Exception as exc:  # noqa: BLE001
            send({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
