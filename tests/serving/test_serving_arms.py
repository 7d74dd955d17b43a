"""The arms of a serving run (spectoolkit.serving.assemble.serving_arms) on the embedded model.

Issue 57: ``bench.arms=gamma_sweep`` under load runs the target alone, one fixed-γ arm per ``bench.gammas`` and the
adaptive policy at most max(gammas), interleaved in one sweep (a stateful drafter: one variant per arm).
"""

from __future__ import annotations

import pytest

from spectoolkit.config import run_config_from_dict
from spectoolkit.serving.api import ServeRequest

CONFIG = {
    "draft": {"kind": "ngram"},
    "serve": {"enabled": True, "max_kv_tokens": 2048, "concurrency": [1, 2]},
    "runtime": {"kernels": "reference"},
    "bench": {"calibrate": False, "baseline_check": False, "arms": "gamma_sweep", "gammas": [2, 4]},
}


@pytest.fixture(scope="module")
def arms():
    from spectoolkit.serving.assemble import serving_arms
    from spectoolkit.wiring.setup import build

    cfg = run_config_from_dict(CONFIG)
    return serving_arms(cfg, build(cfg, arms=False))


def test_a_gamma_sweep_under_load_has_every_fixed_gamma_and_the_adaptive_policy(arms):
    assert [arm.name for arm in arms] == ["baseline", "spec-g2", "spec-g4", "spec-adaptive"]
    assert [(arm.policy, arm.gamma) for arm in arms] == [("none", 0), ("fixed", 2), ("fixed", 4), ("adaptive", 4)]
    assert len({id(arm.engine) for arm in arms}) == len(arms)
    assert all(arm.engine.policy.max_gamma == arm.gamma for arm in arms)
    ids = list(range(5, 40))
    outputs = []
    for arm in arms:
        arm.engine.submit(ServeRequest("r", ids, 8))
        done = []
        while arm.engine.has_work():
            done += arm.engine.step()
        outputs.append(done[0].output_ids)
    assert all(out == outputs[0] for out in outputs), "a drafting arm's output differs from the target alone"
