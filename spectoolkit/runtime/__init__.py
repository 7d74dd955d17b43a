"""The one engine's parts: the step description, the paged KV pool and block tables, model runners.

Layers, imports pointing down: ``blocks`` and ``paged_kv`` (KV blocks and their storage) → ``step``
(:class:`StepBatch`, what one forward computes) → ``attention`` (rows over the pool) → ``runner`` (the
``forward(batch)`` interface) → ``eager`` (the model's modules, our decoder loop).
"""
