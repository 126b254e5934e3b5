"""Candidate trees as the decode loop runs them: ``buffers.py`` (a tree's index tensors: ancestor mask, candidate
offsets, retrieve paths), ``compiler.py`` (every layout a decoder verifies of one tree, and the levels
path-conditioned heads run), ``lookup.py`` (the prompt-lookup chain laid beside the heads' tree)."""
