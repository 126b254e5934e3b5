"""Medusa heads: ``medusa.py`` (the heads module, both checkpoint formats, the shipped sets, ``resolve_heads``),
``native.py`` (root- and path-conditioned heads in the C library), ``adapter.py`` (a Medusa-2 head set's base
adapter merged at load), ``export.py`` (the layouts serving engines load: vLLM and TGI folders)."""
