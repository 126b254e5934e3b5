"""Training Medusa heads (Medusa-1: frozen base; Medusa-2: base and heads together) on self-distilled data.

Nothing under ``medusa_runtime`` outside this package imports it: decoding, calibration and serving load
trained heads (and a Medusa-2 base adapter, ``medusa_runtime.heads.adapter``) without the training stack.
"""
