"""What bench, server and eval share to put a run together: load its models (quantized or not) and build its arms.

:mod:`spectoolkit.wiring.loading` loads a checkpoint at a precision (float, or through a quantization
backend of :mod:`spectoolkit.quant`); :mod:`spectoolkit.wiring.setup` builds a run's models, compat check,
drafter, verifier and arms from its config. Below its three users (DESIGN §4), above everything it wires.
"""
