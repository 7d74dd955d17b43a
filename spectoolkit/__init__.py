"""spectoolkit: exact speculative decoding with quantized models, measured honestly.

The library works without Hydra: build a :class:`spectoolkit.config.RunConfig` and call
:func:`spectoolkit.bench.protocol.runner.run`. ``python -m spectoolkit`` is a thin Hydra wrapper around it.
"""

import hashlib
import logging
import re

from spectoolkit.errors import SpecToolkitError

__all__ = ["SpecToolkitError", "job_dir_name"]
__version__ = "0.1.0"

_MAX_DIR_NAME = 160  # well under the 255 bytes a file name may have


def job_dir_name(override_dirname: str) -> str:
    """A sweep job's directory name from its overrides (``+draft=int4,speculate.gamma=2``).

    The same overrides always give the same directory, so a re-run of a sweep finds its finished jobs
    even when Hydra numbers them differently. Characters a path cannot hold safely become ``_``; a
    name that had to change or be shortened gets a hash of the original, so two jobs never share one.
    """
    if not override_dirname:
        return "default"
    name = re.sub(r"[^A-Za-z0-9=,.+~_@:%-]", "_", override_dirname)[:_MAX_DIR_NAME]
    if name != override_dirname:
        name += "-" + hashlib.sha256(override_dirname.encode()).hexdigest()[:8]
    return name


def _register_resolvers() -> None:
    # Imported by every process that resolves a job directory (Hydra's launchers unpickle the task
    # function, which imports this package), so the resolver exists wherever conf/config.yaml is read.
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("spectoolkit_job_dir"):
        OmegaConf.register_new_resolver("spectoolkit_job_dir", job_dir_name)


def _quiet_libraries() -> None:
    # transformers imports torchao on every model load once it is installed (it is: the stock baseline
    # check's counterpart of rtn-*); torchao then warns that its CUDA-only extensions did not load, and
    # registers enums in a way torch calls deprecated. Neither concerns a run, and both print every time.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


_register_resolvers()
_quiet_libraries()
