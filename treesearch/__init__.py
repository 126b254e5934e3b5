"""Candidate trees for Medusa decoding, as data (pure Python; no torch import)."""
