"""``backend.*`` from the command line: every key of BackendConfig composes for every backend, arrives typed, and
one that does nothing for the chosen backend is one clear error (spectoolkit/config_checks.py), not Hydra's
"Key 'port' is not in struct".

Composes through Hydra's compose API as tests/test_config.py does.
"""

from __future__ import annotations

import dataclasses
from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from spectoolkit.__main__ import config_from_hydra
from spectoolkit.config import BackendConfig, RunConfig
from spectoolkit.config_checks import check_config, override_keys
from spectoolkit.errors import SpecToolkitError

OUT = "/tmp/spectoolkit-test-out"
URL = "http://127.0.0.1:8000/v1"
BACKENDS = sorted(f.name.removesuffix(".yaml") for f in files("spectoolkit.conf").joinpath("backend").iterdir()
                  if f.name.endswith(".yaml"))  # fmt: skip
FIELDS = {f.name: f.default for f in dataclasses.fields(BackendConfig)}
# The vllm keys the README documents, set away from their defaults.
VLLM_OVERRIDES = {
    "port": 8200, "vllm_env": "/opt/vllm-env", "vllm_args": ["--enforce-eager", "--max-num-seqs", "8"],
    "vllm_kv_cache_gib": 4, "eagle_path": "/heads/eagle3", "vllm_threads_bind": "auto", "host": "localhost",
    "connect_timeout_s": 5.0, "read_timeout_s": 60.0, "request_timeout_s": 300.0, "startup_timeout_s": 1200.0,
    "allow_remote": True, "model": "served-id", "api_key": "secret",
}  # fmt: skip


def _compose(*overrides: str):
    with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
        return compose(config_name="config", overrides=[f"output_dir={OUT}", *overrides])


def _checked(*overrides: str) -> RunConfig:
    """The config a ``python -m spectoolkit ...`` run gets, through the CLI's config checks."""
    config = config_from_hydra(_compose(*overrides))
    check_config(config, override_keys(overrides), "run")
    return config


def _override(key: str, value: object) -> str:
    text = f"[{','.join(value)}]" if isinstance(value, list) else str(value).lower() if value is True else value
    return f"backend.{key}={text}"


def test_vllm_backend_takes_every_documented_key() -> None:
    overrides = [_override(key, value) for key, value in VLLM_OVERRIDES.items()]
    backend = _checked("experiment=concurrency_sweep", "backend=vllm", *overrides).backend
    assert backend.kind == "vllm"
    for key, value in VLLM_OVERRIDES.items():
        assert getattr(backend, key) == (tuple(value) if isinstance(value, list) else value), key


def test_backend_port_alone() -> None:
    """The README's command: ``backend=vllm backend.port=8200``."""
    backend = _checked("experiment=concurrency_sweep", "backend=vllm", "backend.port=8200").backend
    assert (backend.kind, backend.port) == ("vllm", 8200)


def test_endpoint_backend_takes_its_urls() -> None:
    overrides = [f"backend.baseline_url={URL}", "backend.spec_url=http://127.0.0.1:8001/v1", "backend.model=m"]
    backend = _checked("experiment=concurrency_sweep", "backend=endpoint", *overrides).backend
    assert (backend.baseline_url, backend.spec_url, backend.model) == (URL, "http://127.0.0.1:8001/v1", "m")


def test_endpoint_without_a_baseline_url_says_what_to_set() -> None:
    with pytest.raises(SpecToolkitError, match=r"backend=endpoint needs backend.baseline_url=URL"):
        _checked("experiment=concurrency_sweep", "backend=endpoint")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["backend=endpoint", f"backend.baseline_url={URL}", "backend.port=8200"],
      r"backend.port has no effect without servers to start \(backend=vllm or llamacpp\): set backend=vllm or "
      "backend=llamacpp, or drop the override"),
     (["backend.port=8200"], "backend.port has no effect without servers to start"),
     (["backend=vllm", "backend.llamacpp_slots=4"], "backend.llamacpp_slots has no effect without backend=llamacpp"),
     (["backend=vllm", f"backend.baseline_url={URL}"], "backend.baseline_url has no effect without backend=endpoint"),
     (["backend.read_timeout_s=5"], "backend.read_timeout_s has no effect with backend=local")],
)  # fmt: skip
def test_a_key_for_another_backend_is_one_clear_error(overrides: list[str], message: str) -> None:
    """Composes (every key is in every backend's file), then the CLI's check names the switch."""
    with pytest.raises(SpecToolkitError, match=message):
        _checked("experiment=concurrency_sweep", *overrides)


@pytest.mark.parametrize("option", BACKENDS)
def test_backend_files_hold_only_backend_config_fields(option: str) -> None:
    """Each file's keys are fields; composed, every field is there (settable) with BackendConfig's default."""
    written = OmegaConf.to_container(
        OmegaConf.load(str(files("spectoolkit.conf").joinpath("backend", f"{option}.yaml")))
    )
    assert set(written) - {"defaults"} <= set(FIELDS), f"backend/{option}.yaml: keys BackendConfig lacks"
    composed = OmegaConf.to_container(_compose(f"backend={option}").backend)
    assert set(composed) == set(FIELDS)
    defaults = {key: list(value) if isinstance(value, tuple) else value for key, value in FIELDS.items()}
    assert composed == defaults | {"kind": option}
