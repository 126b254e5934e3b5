"""Medusa decoding runtime on Hugging Face causal LMs, grouped by the path the data takes:

    prompt -> engines/ (one forward) -> heads/ (candidates) -> tree/ (the tree's buffers) -> verify (engines/)
           -> decoding/ (acceptance, commit) ; measure/ (calibration, latency profile) ; training/ ; kernels/

What a user calls is importable from here (``from medusa_runtime import load_model, MedusaDecoder``); each name
loads its module, and torch with it, only when first used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
PUBLIC = {
    "load_model": "medusa_runtime.model", "LoadedModel": "medusa_runtime.model",
    "resolve_heads": "medusa_runtime.heads.medusa", "MedusaHeads": "medusa_runtime.heads.medusa",
    "MedusaDecoder": "medusa_runtime.decoding.decode", "DecodeConfig": "medusa_runtime.decoding.decode",
    "encode_prompt": "medusa_runtime.decoding.decode", "AcceptConfig": "medusa_runtime.decoding.acceptance",
    "LookupConfig": "medusa_runtime.tree.lookup", "make_engine": "medusa_runtime.engines",
    "calibrate": "medusa_runtime.measure.calibrate", "CalibrationConfig": "medusa_runtime.measure.calibrate",
    "profile_latency": "medusa_runtime.measure.profile", "ProfileConfig": "medusa_runtime.measure.profile",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'medusa_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])
