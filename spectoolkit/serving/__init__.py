"""Serving under load: continuous batching with per-request draft lengths over paged KV (issue 15).

Layers, imports pointing down: ``api`` (what goes in and out) → ``blocks`` and ``paged_kv`` (KV
blocks and their storage) → ``ragged`` (one forward over many sequences) → ``sequence`` and
``scheduler`` → ``drafters`` → ``engine`` → ``factory`` (the arms of a run).
"""
