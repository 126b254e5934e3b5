"""Medusa decoding runtime on Hugging Face causal LMs: heads, tree buffers, acceptance rules, decode loop."""

__version__ = "0.1.0"
