"""Serving under load: continuous batching with per-request draft lengths over paged KV (issue 15).

Layers, imports pointing down: ``api`` (what goes in and out) → ``sequence`` and ``scheduler`` →
``drafters`` → ``engine`` → ``factory`` (the arms of a run). Blocks, the paged pool, the step
description and the model runner live below, in :mod:`spectoolkit.runtime`.
"""
