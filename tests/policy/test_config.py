"""``speculate`` settings of the draft-length policies (spectoolkit.config.SpeculateConfig) and make_policy."""

from __future__ import annotations

import pytest

from spectoolkit.config import DRAFT_POLICIES, SpeculateConfig, run_config_from_dict
from spectoolkit.errors import SpecToolkitError
from spectoolkit.policy import AdaptivePolicy, ConfidencePolicy, FixedPolicy, make_policy


def test_defaults_are_the_fixed_policy() -> None:
    cfg = SpeculateConfig()
    assert (cfg.gamma, cfg.policy, cfg.confidence, cfg.decay, cfg.probe_every) == (4, "fixed", 0.4, 0.9, 8)
    assert set(DRAFT_POLICIES) == {"fixed", "adaptive", "confidence"}


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        ({"gamma": 0}, r"speculate\.gamma=0"),
        ({"gamma": 65}, r"speculate\.gamma=65"),
        ({"policy": "greedy"}, r"speculate\.policy='greedy'.*fixed, adaptive, confidence"),
        ({"confidence": 0.0}, r"speculate\.confidence=0\.0"),
        ({"confidence": 1.0}, r"speculate\.confidence=1\.0"),
        ({"confidence": -0.5}, r"speculate\.confidence"),
        ({"decay": 0.0}, r"speculate\.decay=0\.0"),
        ({"decay": 1.5}, r"speculate\.decay=1\.5"),
        ({"probe_every": 0}, r"speculate\.probe_every=0"),
        ({"probe_every": -3}, r"speculate\.probe_every=-3"),
    ],
    ids=str,
)
def test_bad_values_name_the_option(values: dict, pattern: str) -> None:
    with pytest.raises(SpecToolkitError, match=pattern):
        SpeculateConfig(**values)


@pytest.mark.parametrize(
    "values",
    [
        {"policy": "adaptive", "decay": 1.0, "probe_every": 1},  # decay 1: never forget
        {"policy": "confidence", "confidence": 0.01},
        {"policy": "confidence", "confidence": 0.99},
        {"gamma": 64, "policy": "adaptive", "decay": 1e-3},
    ],
    ids=str,
)
def test_edge_values_are_accepted(values: dict) -> None:
    cfg = SpeculateConfig(**values)
    assert all(getattr(cfg, name) == value for name, value in values.items())


def test_run_config_builds_and_validates_the_policy_fields() -> None:
    cfg = run_config_from_dict({"speculate": {"policy": "adaptive", "decay": 0.8, "probe_every": 4}})
    assert cfg.speculate == SpeculateConfig(policy="adaptive", decay=0.8, probe_every=4)
    with pytest.raises(SpecToolkitError, match=r"speculate\.policy"):
        run_config_from_dict({"speculate": {"policy": "sometimes"}})
    with pytest.raises(SpecToolkitError, match=r"speculate\.probe_every"):
        run_config_from_dict({"speculate": {"probe_every": 0}})


@pytest.mark.parametrize(
    ("policy", "cls"), [("fixed", FixedPolicy), ("adaptive", AdaptivePolicy), ("confidence", ConfidencePolicy)]
)
def test_make_policy_picks_the_class_of_the_config(policy: str, cls: type) -> None:
    cfg = SpeculateConfig(gamma=6, policy=policy, confidence=0.3, decay=0.7, probe_every=5)
    made = make_policy(cfg)
    assert type(made) is cls and made.name == policy and made.max_gamma == 6
    assert made.stop_below == (0.3 if policy == "confidence" else None)
    if policy == "adaptive":
        assert (made.acceptance.decay, made.probe_every) == (0.7, 5)


def test_make_policy_kind_and_max_gamma_override_the_config() -> None:
    cfg = SpeculateConfig(gamma=3, policy="adaptive")
    assert type(make_policy(cfg, "fixed")) is FixedPolicy
    assert type(make_policy(cfg, "confidence", 7)) is ConfidencePolicy
    wider = make_policy(cfg, max_gamma=8)
    assert type(wider) is AdaptivePolicy and wider.max_gamma == 8 and wider.acceptance.max_gamma == 8
    assert make_policy(cfg).max_gamma == 3
