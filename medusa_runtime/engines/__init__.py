"""Forward engines: what one verify pass costs is decided here.

Every engine answers the same three calls the decode loop makes::

    cache  = engine.new_cache(capacity)                       # room for `capacity` positions
    logits, hidden = engine.forward(ids [n], start, cache, tree)  # n new tokens at positions start..
    engine.compact(cache, start, path)                        # keep only the accepted nodes' keys/values

* ``hf`` (``hf.py``): any transformers causal LM, through its own forward;
* ``lean`` (``lean.py``): Llama-family models on flat fused weights, with the C forward on bf16 CPUs and
  CUDA graphs of fixed-shape steps (``graphs.py``) on CUDA; ``lean-torch`` keeps it on eager PyTorch ops and
  ``lean-static`` runs the fixed-shape steps eagerly;
* ``logit_screen.py``: the int8 screen of the logits projection that greedy C steps take their argmax through.

``make_engine`` picks one.
"""

from __future__ import annotations

from medusa_runtime.engines.base import ENGINES, EngineError
from medusa_runtime.engines.hf import HFEngine
from medusa_runtime.engines.lean import LeanEngine, lean_support
from medusa_runtime.model import LoadedModel


def make_engine(loaded: LoadedModel, name: str = "auto", max_nodes: int = 1) -> HFEngine | LeanEngine:
    """``auto``: the lean engine where it supports the model, else transformers'. ``lean`` takes the C
    forward for decode steps where it pays (bf16 CPU) and CUDA graphs of fixed-shape steps on CUDA;
    ``lean-torch`` keeps the lean engine on eager PyTorch ops; ``lean-static`` runs the fixed-shape steps
    eagerly."""
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; use one of {ENGINES}")
    if loaded.weights == "q4_1" and (name not in ("auto", "lean") or lean_support(loaded)):
        why = lean_support(loaded) or f"engine {name!r} runs the dense weights"
        raise EngineError(f"Q4_1 weights run on the lean engine's C forward only ({why})")
    if name == "hf" or (name == "auto" and lean_support(loaded)):
        return HFEngine(loaded)
    if name == "lean-torch":
        return LeanEngine(loaded, max_nodes, use_kernels=False, static_steps=False)
    if name == "lean-static":
        return LeanEngine(loaded, max_nodes, use_kernels=False, static_steps=True, graphs=False)
    return LeanEngine(loaded, max_nodes)
