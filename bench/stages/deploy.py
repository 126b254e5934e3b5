"""From the final ``tree.json`` to what a target loads: ``medusa-bench export TREE --target T --out DIR``.

The file names its heads (a shipped set by name, or a folder, with the digest of its contents) and the
configuration to deploy. Anything the target cannot run (a lookup chain, a gate, conditioned heads, a tree
where it drafts a chain, more nodes than its engines verify) is refused in one line, never dropped: the
deployed speed would otherwise not be the predicted one.

Per target, ``DIR`` holds:

* ``vllm``: the vLLM Medusa model folder (``config.json``, ``model.safetensors``) and
  ``speculative_config.json`` (``method: medusa``, ``model``: the folder itself, ``num_speculative_tokens``:
  the chain's length), for ``--speculative-config``;
* ``trtllm``: the heads in the official layout TensorRT-LLM converts (``medusa_lm_head.safetensors``,
  ``config.json``), ``medusa_choices.txt`` (the ``--medusa_choices`` argument) and
  ``extra_llm_api_options.yaml`` (the LLM API's ``speculative_config``: ``decoding_type: Medusa``,
  ``max_draft_len`` = draft tokens = tree nodes, ``num_medusa_heads`` = the heads in the checkpoint,
  ``medusa_choices``, ``speculative_model``);
* ``tgi``: the TGI Medusa folder and ``speculate.json`` (the ``--speculate`` chain length);
* ``own``: ``tree.json`` and the command line that serves it with this runtime.

A tree.json with a ``schedule`` (a configuration per range of batch sizes) goes to the engines that switch by
batch size, where they can run it. vLLM reads ``num_speculative_tokens_per_batch_size`` (inclusive
``[first, last, K]`` ranges, ``vllm/v1/spec_decode/dynamic/utils.py``), but its Medusa drafter takes one draft
length: 0.32's ``MedusaProposer.propose`` (``vllm/v1/spec_decode/medusa.py``) asserts that every step's K is
``num_speculative_tokens``, so the engine fails at the first step whose batch size the schedule gives another K.
A vLLM schedule is therefore written only when every range drafts the same chain (as the fixed configuration);
one that switches is refused. TensorRT-LLM reads ``draft_len_schedule`` (``{first batch size: draft tokens}``,
its entry for batch 1 equal to ``max_draft_len``:
``tensorrt_llm/llmapi/llm_args.py``, ``validate_draft_len_schedule_and_sort``). TensorRT-LLM keeps one
``medusa_choices`` and shortens the draft, so every range's tree must be a prefix of batch 1's (the schedule
search for ``--target trtllm`` only picks such trees). TGI takes no schedule: refused.

Medusa-2 heads decode on an adapted base: it is written to ``DIR/base`` and named as the model to serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from bench.stages.cache import folder_hash
from bench.stages.common import adapted
from medusa_runtime.heads import export as serving
from medusa_runtime.heads.medusa import SHIPPED, adapter_entry, heads_folder, resolve_heads, shipped_heads_dir
from medusa_runtime.model import load_model
from treesearch.export import to_trtllm_config
from treesearch.schedule import check_schedule
from treesearch.stats import StatsError
from treesearch.targets import get_target, heads_conditioning, is_chain, refusal_line, refusals
from treesearch.tree import make_tree, official_order, read_json

TRTLLM_CHOICES = "medusa_choices.txt"
TRTLLM_OPTIONS = "extra_llm_api_options.yaml"  # JSON is YAML: trtllm-serve --extra_llm_api_options FILE
TGI_SPECULATE = "speculate.json"


class DeployError(ValueError):
    """A configuration that cannot be deployed where asked, with a one-line reason."""


def heads_reference(folder: str | Path) -> dict[str, Any]:
    """What tree.json says of its heads: a shipped set's name (else the folder's path), the digest of the
    folder's contents, and what a target checks (heads, layers, conditioning, a base adapter)."""
    folder = Path(folder).resolve()
    cfg = json.loads((folder / "config.json").read_text())
    name = next((n for n in SHIPPED if shipped_heads_dir(n) == folder), None)
    return {"name": name, "path": None if name else str(folder), "digest": folder_hash(folder),
            "num_heads": cfg.get("medusa_num_heads"), "num_layers": cfg.get("medusa_num_layers", 1),
            "conditioning": heads_conditioning(cfg), "base_adapter": adapter_entry(folder) is not None}


def heads_spec(ref: dict[str, Any]) -> str:
    """The heads a tree.json names, as ``--heads`` takes them; refused when their contents are not the ones
    the configuration was searched with."""
    spec = ref.get("name") or ref.get("path")
    folder = heads_folder(spec) if spec else None
    if folder is None or not (folder / "config.json").is_file():
        raise DeployError(f"the heads the configuration needs are not here: {spec}")
    digest = folder_hash(folder) if ref.get("digest") else None
    if digest is not None and digest != ref["digest"]:
        raise DeployError(f"heads {spec} differ from the ones the configuration was searched with (digest "
                          f"{digest}, not {ref['digest']})")
    return str(spec)


def configuration(obj: dict[str, Any]) -> dict[str, Any]:
    """The configuration a tree file deploys: the final file's ``configuration``, else its tree with the
    lookup chain and gate that go with it."""
    if isinstance(obj.get("configuration"), dict):
        return obj["configuration"]
    decoding = obj.get("decoding") or {}
    return {"config": obj.get("name"), "uses_heads": True, "medusa_choices": obj.get("medusa_choices"),
            "tree_nodes": len(obj.get("medusa_choices") or []), "lookup": int(decoding.get("lookup", 0)),
            "gate": float(decoding.get("gate", 0.0))}


def check(obj: dict[str, Any], target_name: str, heads: dict[str, Any]) -> dict[str, Any]:
    """The configuration, refused in one line where the target cannot run all of it."""
    target = get_target(target_name)
    conf = configuration(obj)
    if not conf.get("medusa_choices"):
        if target.name == "own":
            return conf
        raise DeployError(f"the configuration uses no heads: there is nothing to export to {target.engine}")
    reasons = refused(target, conf, heads)
    if reasons:
        raise DeployError(refusal_line(target, reasons))
    return conf


def refused(target, conf: dict[str, Any], heads: dict[str, Any]) -> list[str]:
    """What of a configuration with heads ``target`` cannot run, with these heads (``treesearch.targets``)."""
    return refusals(target, conf["medusa_choices"], conf.get("lookup", 0), conf.get("gate", 0.0),
                    heads.get("conditioning", "none"), heads.get("num_heads"))


def export(tree_file: str | Path, target: str, out: str | Path, model: str = "default", dtype: str = "bfloat16",
           base_model: str | None = None, log=print) -> dict[str, Any]:
    """Write what ``target`` loads for the configuration of ``tree_file`` into ``out``; returns what was
    written, with the command that serves it."""
    obj = read_json(tree_file, DeployError, "tree file")
    if not isinstance(obj, dict) or "medusa_choices" not in obj:
        raise DeployError(f"{tree_file} is not a tree file")
    if not isinstance(obj.get("heads"), dict):
        raise DeployError(f"{tree_file} names no heads (a search's final tree.json does): nothing to deploy with")
    searched_for = obj.get("target", "own")
    conf = check(obj, target, obj["heads"])
    if searched_for != target:
        log(f"note: this configuration was searched for {searched_for}, not {target}; it runs there, but the "
            f"search over what {target} runs may find a faster one (--target {target})")
    spec = heads_spec(obj["heads"]) if conf.get("medusa_choices") else "none"
    out = Path(out)
    if target == "own":
        return _export_own(tree_file, obj, conf, spec, out)
    return _export_engine(target, conf, spec, out, model, dtype, base_model, log, schedule_for(obj, target))


def schedule_for(obj: dict[str, Any], target_name: str) -> list[tuple[int, int, dict[str, Any]]] | None:
    """A tree file's schedule as ``(first, last, configuration)``, each range checked against the target (None:
    the file has no schedule)."""
    if "schedule" not in obj:
        return None
    target = get_target(target_name)
    try:
        entries = check_schedule(obj["schedule"])
    except StatsError as exc:
        raise DeployError(str(exc)) from None
    if target.name == "tgi":
        raise DeployError("text-generation-inference takes one --speculate for every batch size: it cannot run a "
                          "schedule (export a file without one)")
    out = []
    for e in entries:
        conf, (first, last) = e["configuration"], e["batch"]
        if conf.get("medusa_choices"):
            if reasons := refused(target, conf, obj["heads"]):
                raise DeployError(f"batch sizes {first}-{last}: " + refusal_line(target, reasons))
        elif conf.get("lookup"):
            raise DeployError(f"batch sizes {first}-{last}: {target.engine} cannot run a prompt-lookup chain of "
                              f"{conf['lookup']} tokens without heads: search for it with --target {target.name}")
        out.append((int(first), int(last), conf))
    if target.name == "vllm":
        vllm_draft_length(out)  # refused before the model loads
    return out


def vllm_draft_length(schedule: list[tuple[int, int, dict[str, Any]]]) -> int:
    """The one chain length vLLM's Medusa drafter runs for every range of the schedule; refused when the ranges
    ask for different lengths (plain decoding is length 0), which that drafter cannot switch between."""
    lengths = [len(conf.get("medusa_choices") or []) for _, _, conf in schedule]
    if len(set(lengths)) > 1:
        asked = ", ".join(f"{first}-{last}: {k}" for (first, last, _), k in zip(schedule, lengths))
        raise DeployError(f"vLLM's Medusa drafter runs one draft length at every batch size (0.32's "
                          f"MedusaProposer.propose asserts it), and this schedule switches it ({asked}): export a "
                          f"tree file without a schedule, or serve the schedule with medusa-bench serve")
    return lengths[0]


def trtllm_schedule(schedule: list[tuple[int, int, dict[str, Any]]]) -> tuple[list[list[int]], dict[str, int]]:
    """(``medusa_choices``: batch 1's tree, ``draft_len_schedule``: ``{first: draft tokens}``), refused where a
    range's tree is not a prefix of batch 1's (the engine only shortens its one draft)."""
    choices = schedule[0][2].get("medusa_choices") or []
    if not choices:
        raise DeployError("TensorRT-LLM's draft_len_schedule starts from batch 1's draft (max_draft_len): this "
                          "schedule decodes plain at batch 1")
    order = official_order(choices)
    lengths = {}
    for first, last, conf in schedule:
        tree = official_order(conf.get("medusa_choices") or [])
        if tree != order[:len(tree)]:
            raise DeployError(f"batch sizes {first}-{last}: TensorRT-LLM keeps one medusa_choices and shortens its "
                              "draft; this range's tree is not a prefix of batch 1's (search with --target trtllm)")
        lengths[str(first)] = len(tree)
    return [list(p) for p in order], lengths


def _export_own(tree_file, obj, conf, spec, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tree_file, out / "tree.json")
    if "schedule" in obj:  # the configuration follows the live batch size
        cmd = f"medusa-bench serve --heads {heads_spec(obj['heads'])} --schedule {out.resolve() / 'tree.json'}"
        return {"target": "own", "out": str(out), "command": cmd}
    tree = f" --tree {out.resolve() / 'tree.json'}" if spec != "none" else ""
    cmd = (f"medusa-bench serve --heads {spec}{tree} --lookup {conf.get('lookup', 0)}"
           + (f" --gate {conf['gate']:g}" if conf.get("gate") else ""))
    return {"target": "own", "out": str(out), "command": cmd}


def _export_engine(target: str, conf: dict, spec: str, out: Path, model: str, dtype: str, base_model: str | None,
                   log, schedule: list[tuple[int, int, dict[str, Any]]] | None = None) -> dict[str, Any]:
    loaded = load_model(model, "float32", "cpu", log=log)
    heads = resolve_heads(spec, loaded.hidden_size, loaded.vocab_size, model)
    merged = adapted(loaded, spec)
    base = merged if merged is not loaded else None  # Medusa-2 heads: the engine serves the adapted base
    lm = merged.model.get_output_embeddings().weight
    torch_dtype = getattr(torch, dtype)
    choices = conf["medusa_choices"]
    notes: list[str] = []
    base_path = f"{out.resolve()}/{serving.BASE_DIR}" if base is not None else None
    base_name = base_model or (str(loaded.model.config._name_or_path) if model == "default" else model)
    if target == "vllm":
        depth = vllm_draft_length(schedule) if schedule else len(choices)
        if not depth:
            raise DeployError("the schedule decodes plain at every batch size: serve vLLM without speculation")
        serving.export_vllm(heads, lm, out, depth, torch_dtype, base=base, warn=notes.append)
        spec_cfg = json.loads((out / serving.VLLM_SPEC_FILE).read_text())
        serve = base_path or base_name
        cmd = f"vllm serve {serve} --speculative-config '{json.dumps(spec_cfg)}'"
        result = {"speculative_config": spec_cfg}
    elif target == "trtllm":
        draft_lens = None
        if schedule:
            choices, draft_lens = trtllm_schedule(schedule)
        serving.export_trtllm(heads, lm, out, base_name, torch_dtype, warn=notes.append, base=base)
        options = json.loads(to_trtllm_config(make_tree(choices), heads.num_heads))
        if draft_lens is not None:
            options["speculative_config"]["draft_len_schedule"] = draft_lens
        options["speculative_config"]["speculative_model"] = str(out.resolve())
        (out / TRTLLM_OPTIONS).write_text(json.dumps(options, indent=1) + "\n")
        (out / TRTLLM_CHOICES).write_text(f"{choices}\n")
        cmd = f"trtllm-serve {base_path or base_name} --extra_llm_api_options {out.resolve() / TRTLLM_OPTIONS}"
        result = options
    else:
        assert is_chain(choices)
        serving.export_tgi(heads, lm, out, base_name, torch_dtype, warn=notes.append, base=base)
        (out / TGI_SPECULATE).write_text(json.dumps({"speculate": len(choices)}) + "\n")
        cmd = f"text-generation-launcher --model-id {out.resolve()} --speculate {len(choices)}"
        result = {"speculate": len(choices)}
    return {"target": target, "out": str(out), "heads": spec, "configuration": conf, **result, "notes": notes,
            "base": base_path, "command": cmd}
