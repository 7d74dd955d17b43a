"""Package discovery (pyproject.toml holds everything else): no hand-kept list that can forget a package.

Every package under ``spectoolkit/`` (with or without ``__init__.py``), plus the top-level ``conf/`` and
``kernels/`` trees, which ship as ``spectoolkit.conf`` and ``spectoolkit.kernels`` (``package-dir`` in
pyproject.toml). ``tests/test_wheel.py`` builds the wheel and fails on any missing module or data file.
"""

from setuptools import find_namespace_packages, setup

_SKIP = ["*__pycache__*", "*.egg-info*"]


def _tree(directory: str, package: str) -> list[str]:
    """``package`` and every sub-package found in ``directory``, named under ``package``."""
    return [package] + [f"{package}.{sub}" for sub in find_namespace_packages(directory, exclude=_SKIP)]


setup(
    packages=find_namespace_packages(include=["spectoolkit", "spectoolkit.*"], exclude=_SKIP)
    + _tree("conf", "spectoolkit.conf")
    + _tree("kernels", "spectoolkit.kernels")
)
