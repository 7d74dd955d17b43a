"""spectoolkit: exact speculative decoding with quantized models, measured honestly.

The library works without Hydra: build a :class:`spectoolkit.config.RunConfig` and call
:func:`spectoolkit.bench.runner.run`. ``python -m spectoolkit`` is a thin Hydra wrapper around it.
"""

from spectoolkit.errors import SpecToolkitError

__all__ = ["SpecToolkitError"]
__version__ = "0.1.0"
