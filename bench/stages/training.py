"""What the commands that train heads run (their parsers: bench.commands.training): distill (the training replies,
resumable shards), train (Medusa-1 / Medusa-2, resumable), learning-curve (train at several data sizes, measure
each), self-prompts, and fidelity (the adapted base against the original)."""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench.judge.proxies import fidelity
from bench.replay.suites import load_suite, write_questions
from bench.replay.workload import spread_over_categories
from bench.report.learning_curve import SCHEMA, TAU_NODES, curve_fits, curve_table, point_row
from bench.stages import defaults
from bench.stages.common import adapted, dense_only, emit, log, show
from bench.stages.jobs import CalibrateJob, DistillJob, LearningCurveJob, TrainJob
from bench.stages.measure import calibrate_stage, replay_rows
from medusa_runtime.decoding.decode import encode_prompt
from medusa_runtime.model import load_model
from medusa_runtime.prompts import mixed_prompts
from medusa_runtime.training.distill import DistillConfig, build_distill_data
from medusa_runtime.training.medusa2 import train_medusa2_top
from medusa_runtime.training.profiles import TRAIN_PROFILES
from medusa_runtime.training.selfprompts import SelfPromptConfig, generate_prompts, model_sampler
from medusa_runtime.training.train import TrainConfig, train_medusa1, train_medusa2
from treesearch.stats import load_stats
from treesearch.tree import chain, write_json_atomic

if TYPE_CHECKING:
    from medusa_runtime.training.distill import DistillConfig


def cmd_train(args: argparse.Namespace) -> int:
    dense_only(args, "training")
    return show(args, train_stage, TrainJob.from_namespace(args))


def distill_setup(job: DistillJob) -> tuple[list, dict[str, int], DistillConfig]:
    """The training prompts of a distill or train job (its mix, cut to ``--prompts``), how many each source
    offered, and the self-distillation settings (the ``--profile``'s where a flag is unset)."""
    prof = TRAIN_PROFILES[job.profile]
    n_prompts = job.prompts if job.prompts is not None else prof["prompts"]
    prompts, available = mixed_prompts(job.data, "train")
    prompts = prompts[:n_prompts] if n_prompts else prompts
    dcfg = DistillConfig(max_new_tokens=job.max_new_tokens or prof["max_new_tokens"], batch_size=job.batch_size,
                         follow_ups=prof["follow_ups"] if job.follow_ups is None else job.follow_ups,
                         shard_size=job.shard_size)
    return prompts, available, dcfg


def cmd_distill(args: argparse.Namespace) -> int:
    dense_only(args, "distillation")
    return show(args, distill_stage, DistillJob.from_namespace(args))


def distill_stage(job: DistillJob) -> tuple[dict, str]:
    """The model's own replies to the training prompts, generated where missing from the answer store."""
    prompts, _, dcfg = distill_setup(job)
    loaded = load_model(job.model, job.dtype, job.device, log=log)
    examples, store = build_distill_data(loaded, prompts, dcfg, store=job.answers, log=log)
    tokens = sum(len(e.input_ids) - e.reply_start for e in examples)
    summary = store.summary()
    made = ", ".join(f"{n} on {dev}" for dev, n in summary["made_on"].items()) or "none yet"
    return ({**summary, "prompts": len(prompts), "examples": len(examples), "example_reply_tokens": tokens,
             "distill": dcfg.__dict__},
            f"{len(examples)} replies to {len(prompts)} prompts ({tokens} reply tokens); the store {store.root} "
            f"holds {summary['replies']} replies, {summary['reply_tokens']} reply tokens, in {summary['shards']} "
            f"shards (made: {made})")


def train_stage(args: TrainJob) -> tuple[dict, str]:
    """The heads stage of ``--retrain``: self-distilled data, then Medusa-1 or Medusa-2 training (resumable)."""
    prof = TRAIN_PROFILES[args.profile]
    top = args.method == "medusa2" and args.train_layers > 0  # Medusa-2 on the top layers (medusa_runtime.training.medusa2)
    if args.init is not None and args.method != "medusa1" and not top:
        raise SystemExit("--init (go on training heads trained before) is for --method medusa1, or medusa2 with "
                         "--train-layers")
    # Medusa-2 on the top layers follows the paper's recipe: the next-token loss replaced by KL to the original
    defaults = {"base_lr": 2e-4, "lm_weight": 0.0} if top else {"base_lr": 2e-5, "lm_weight": 1.0}
    cfg = TrainConfig(method=args.method, num_heads=args.num_heads, num_layers=args.layers,
                      epochs=args.epochs if args.epochs is not None else prof["epochs"],
                      lr=args.lr if args.lr is not None else prof["lr"],
                      base_lr=args.base_lr if args.base_lr is not None else defaults["base_lr"],
                      lm_weight=args.lm_weight if args.lm_weight is not None else defaults["lm_weight"],
                      distill_weight=args.distill_weight, heads_warmup_ratio=args.heads_warmup,
                      batch_tokens=args.batch_tokens, seed=args.seed, lora_rank=args.lora_rank,
                      train_layers=args.train_layers if args.method == "medusa2" else 0,
                      head_grad_to_base=args.head_grad_to_base, soft_targets=args.soft_targets,
                      vocab=args.vocab or prof["vocab"], draft_size=args.draft_size,
                      condition=args.condition or prof["condition"])
    prompts, available, dcfg = distill_setup(args)
    used = Counter(p.source for p in prompts)
    loaded = load_model(args.model, args.dtype, args.device, log=log)
    examples, store = build_distill_data(loaded, prompts, dcfg, store=args.answers, log=log)
    if args.max_examples:  # a budget cut over the cached data (same cache as the full run)
        examples = random.Random(args.seed).sample(examples, min(args.max_examples, len(examples)))
    provenance = {"model": args.model, "data": {"source": args.data, "prompts": len(prompts),
                                                "mix": {"available": available, "used_by_source": dict(used)},
                                                "examples": len(examples), "cache": str(store.root),
                                                "answers": store.summary(), "distill": dcfg.__dict__},
                  "profile": args.profile}

    train = train_medusa1 if cfg.method == "medusa1" else train_medusa2_top if top else train_medusa2
    extra = {"hidden_cache": not args.no_hidden_cache, "init": args.init} if cfg.method == "medusa1" else \
        {"init": args.init} if top else {}
    result = train(loaded, examples, cfg, args.out, provenance=provenance, resume=args.resume, log=log, **extra)
    from bench.report.plots import plot_training  # matplotlib: only when plots are asked for

    plots = [str(p) for p in plot_training(args.out)]
    lines = [f"trained {cfg.num_heads} heads ({cfg.method}) in {result.steps} steps, {result.seconds:.0f} s"]
    last = result.validation[-1]["topk"] if result.validation else []
    lines += [f"  head {j}: validation top-1..5 " + " ".join(f"{v:.3f}" for v in row) for j, row in enumerate(last)]
    official = "" if cfg.root_conditioned or top else f"{args.out}/heads-official, "  # no official layout for those
    adapter = " with its base adapter (heads/adapter, merged at load)" if top else ""
    lines.append(f"written: {args.out}/heads (shared lm_head){adapter}, {official}{args.out}/training.json")
    lines += [f"plot: {p}" for p in plots]
    return ({"method": cfg.method, "num_heads": cfg.num_heads, "steps": result.steps, "seconds": result.seconds,
             "validation_topk": last, "out": str(args.out), "plots": plots}, "\n".join(lines))


def cmd_learning_curve(args: argparse.Namespace) -> int:
    dense_only(args, "the learning curve")
    return show(args, learning_curve_stage, LearningCurveJob.from_namespace(args))


def _curve_point(job: LearningCurveJob, prompts: int, folder: Path, questions: Path) -> dict:
    """One point of the curve: the recipe trained on the first ``prompts`` prompts of the mix (continued from its
    checkpoint after a stop), then calibrated on the questions; a finished step is read back, not redone."""
    if not (folder / "training.json").is_file():
        train = TrainJob(**{f.name: getattr(job, f.name) for f in fields(TrainJob)})
        train_stage(replace(train, prompts=prompts, out=str(folder), resume=(folder / "checkpoint").is_dir()))
    acc = folder / "acceptance.json"
    if not acc.is_file():
        calibrate_stage(CalibrateJob(model=job.model, dtype=job.dtype, device=job.device, heads=str(folder / "heads"),
                                     data=str(questions), heldout=0.0, max_new_tokens=job.eval_tokens, out=str(acc)))
    stats = load_stats(acc)
    topk = [[float(row[:r].sum()) for r in (1, stats.topk)] for row in stats.marginal]
    trees = replay_rows(stats, budgets=(TAU_NODES,), extra=(chain(2),))
    return point_row(prompts, json.loads((folder / "training.json").read_text()), topk, trees)


def _curve_points(job: LearningCurveJob, out: Path, record: Path, recipe: dict) -> list[int]:
    """The prompt counts to measure: the job's, and with ``--resume`` those the folder's curve has (finished or
    stopped). One-line refusals: a curve there without ``--resume``, another recipe, more prompts than the mix."""
    points = set(job.points)
    if record.is_file():
        if not job.resume:
            raise ValueError(f"{out} holds a learning curve already: --resume continues it, or name another --out")
        before = json.loads(record.read_text())
        if {k: v for k, v in before.get("recipe", {}).items() if k != "points"} != recipe:
            raise ValueError(f"{record} was made with another recipe; name another --out")
        points |= {p["prompts"] for p in before.get("points", [])}
        points |= {int(d.name.split("-", 1)[1]) for d in out.glob("prompts-*") if (d / "training.json").is_file()
                   or (d / "checkpoint").is_dir()}
    offered = len(mixed_prompts(job.data, "train")[0])
    if max(points) > offered:
        raise ValueError(f"--points {max(points)} exceeds the {offered} training prompts of --data {job.data}")
    return sorted(points)


def learning_curve_stage(job: LearningCurveJob) -> tuple[dict, str]:
    """Heads of one recipe trained on nested prefixes of the prompt mix, each measured on the questions; the
    curve is written after every point (``--resume`` continues a stopped one, or adds points to it)."""
    from bench.report.plots import plot_learning_curve  # matplotlib: only when plots are asked for

    out = Path(job.out)
    record = out / "learning_curve.json"
    # the recipe every point shares: a resumed curve may add points, never change it
    recipe = json.loads(json.dumps({k: v for k, v in asdict(job).items() if k not in ("out", "resume", "points")}))
    points = _curve_points(job, out, record, recipe)
    out.mkdir(parents=True, exist_ok=True)
    questions = write_questions(out / "questions.jsonl", load_suite(job.questions, log=log))
    curve = {"schema": SCHEMA, "recipe": recipe, "questions": job.questions, "eval_tokens": job.eval_tokens,
             "points": [], "fits": {}}
    if not record.is_file():  # the folder now holds this recipe's curve
        write_json_atomic(record, curve)
    for n in points:  # a finished point's training and calibration are read back, not redone
        curve["points"].append(_curve_point(job, n, out / f"prompts-{n}", questions))
        curve["fits"] = curve_fits(curve["points"])
        write_json_atomic(record, curve)
    table = curve_table(curve)
    (out / "learning_curve.md").write_text(table + "\n")
    plots = [str(p) for p in plot_learning_curve(curve, out)]
    return ({**curve, "file": str(record), "plots": plots},
            f"{table}\nwritten: {record}, {out / 'learning_curve.md'}" + "".join(f"\nplot: {p}" for p in plots))


def cmd_self_prompts(args: argparse.Namespace) -> int:
    """Prompts the model writes itself (Magpie), none overlapping a replayed suite -> OUT/prompts.jsonl."""
    dense_only(args, "sampling prompts")
    cfg = SelfPromptConfig(count=args.limit, shard_size=args.shard_size, temperature=args.temperature,
                           top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                           seed=args.seed)
    reference = [t for suite in args.exclude for q in load_suite(suite, log=log) for t in q.turns]
    loaded = load_model(args.model, args.dtype, args.device, log=log)
    kept = generate_prompts(model_sampler(loaded, cfg), args.out, cfg, reference, log=log)
    out = f"{args.out}/prompts.jsonl"
    emit(args, {"prompts": len(kept), "file": out, "excluded_suites": list(args.exclude)},
            f"{len(kept)} prompts -> {out} (train on them: medusa-bench train --data {out})")
    return 0


def cmd_fidelity(args: argparse.Namespace) -> int:
    dense_only(args, "the fidelity check")
    questions = spread_over_categories(load_suite(args.questions, log=log), args.limit)
    original = load_model(args.reference, args.dtype, args.device, log=log)
    # the retrained model: a folder (Medusa-2 on the whole base), or --model with --heads' adapter merged in
    trained = adapted(load_model(args.model, args.dtype, args.device, log=log), args.heads)
    prompts = [encode_prompt(original, q.turns[0], chat=True) for q in questions]
    n = defaults.new_tokens(args.max_new_tokens)
    res = fidelity(original, trained, prompts, n, args.batch_size)
    obj = {"schema": "medusa-fidelity/1", "model": trained.name, "reference": args.reference, "dtype": args.dtype,
           "heads": args.heads,
           "question_ids": [q.question_id for q in questions], "max_new_tokens": n,
           "agreement": res.agreement, "identical": res.identical, "ll_original": res.ll_original,
           "ll_trained": res.ll_trained, "ll_drop": res.ll_drop}
    write_json_atomic(args.out, obj)
    emit(args, {**obj, "file": str(args.out)},
            f"{res.prompts} MT-Bench first turns, greedy, {n} tokens:\n"
            f"  token agreement with the original's answers: {res.agreement:.3f} (identical answers "
            f"{res.identical:.2f})\n  mean log-likelihood of the original's answers: original {res.ll_original:.4f}, "
            f"trained {res.ll_trained:.4f} (drop {res.ll_drop:+.4f} nats/token)\nwritten: {args.out}")
    return 0
