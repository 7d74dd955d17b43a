"""The tree_chain arm set on a tiny checkpoint: chains and token trees at the same verify width, their
records, the summary's ``trees`` section and the report table (issue 19)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectoolkit.bench.protocol.runner import RECORDS_FILE, run
from spectoolkit.config import (
    BenchConfig,
    DraftConfig,
    ModelConfig,
    RunConfig,
    SpeculateConfig,
    TreeConfig,
    WorkloadConfig,
    run_config_from_dict,
)
from spectoolkit.errors import SpecToolkitError

pytestmark = pytest.mark.usefixtures("one_thread")
NODES = (2, 5)


def _config(checkpoint: Path, out: Path, tree: TreeConfig, arms: str = "tree_chain") -> RunConfig:
    return RunConfig(
        draft=DraftConfig(kind="model", precision="bf16"),
        model=ModelConfig(target_path=str(checkpoint)),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=12, num_prompts=2),
        bench=BenchConfig(warmup=0, repeat=1, arms=arms, gammas=NODES, baseline_check=False),
        speculate=SpeculateConfig(gamma=2, tree=tree),
        device="cpu",
        output_dir=str(out),
    )


@pytest.fixture(scope="module")
def tree_run(one_thread, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("trees")
    tree = TreeConfig(kind="static", branching=(2, 1, 1, 1), max_nodes=5)  # 4 deep: deeper than γ = 2
    summary = run(_config(tiny_checkpoint, out, tree), progress=False)
    records = [json.loads(line) for line in (out / RECORDS_FILE).read_text(encoding="utf-8").splitlines()]
    return summary, records, out


def test_tree_chain_arms_are_exact_and_paired_by_width(tree_run) -> None:
    summary, records, _ = tree_run
    assert list(summary["arms"]) == ["baseline", "chain-g2", "tree-n2", "chain-g5", "tree-n5"]
    assert summary["primary_arm"] == "tree-n5"
    assert summary["exact_match"] == {arm: 1.0 for arm in ("chain-g2", "tree-n2", "chain-g5", "tree-n5")}
    for nodes in NODES:
        chain, tree = summary["trees"][f"chain-g{nodes}"], summary["trees"][f"tree-n{nodes}"]
        assert chain["tree"] is None and tree["tree"] == f"static[2,1,1,1]/{nodes}"
        assert chain["verify_width"] <= nodes + 1 and tree["verify_width"] <= nodes + 1
        assert tree["mean_accept_length"] == pytest.approx(1 + tree["mean_accepted"])
        assert sum(tree["accepted_counts"]) == tree["rounds"]


def test_tree_records_carry_shape_and_depths(tree_run) -> None:
    _, records, _ = tree_run
    trees = [r for r in records if r["arm"].startswith("tree-")]
    assert trees and all(r["schema_version"] == 5 for r in records)
    for record in trees:
        nodes = int(record["arm"].split("-n")[1])
        assert record["tree"] == f"static[2,1,1,1]/{nodes}" and record["draft_len"] == nodes
        assert len(record["tree_depths"]) == len(record["draft_lengths"]) == len(record["accept_lengths"])
        rounds = zip(record["accept_lengths"], record["tree_depths"], record["draft_lengths"], strict=True)
        assert all(k <= d <= n <= nodes for k, d, n in rounds)
    assert max(d for r in trees for d in r["tree_depths"]) > 2  # a static tree is len(branching) deep, not γ
    assert all(r["tree"] is None and not r["tree_depths"] for r in records if r["arm"].startswith("chain-"))


def test_report_compares_trees_with_chains(tree_run) -> None:
    _, _, out = tree_run
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Token trees vs chains" in report
    assert "| tree-n5 | static[2,1,1,1]/5 |" in report and "| chain-g5 | chain |" in report


def test_tree_config_mistakes_are_one_clear_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecToolkitError, match="speculate.tree.kind=static or dynamic"):
        run(_config(tiny_checkpoint, tmp_path, TreeConfig()), progress=False)
    with pytest.raises(SpecToolkitError, match="speculate.policy=fixed or adaptive"):
        run_config_from_dict({"speculate": {"policy": "confidence", "tree": {"kind": "static"}}})
    assert run_config_from_dict({"speculate": {"policy": "adaptive", "tree": {"kind": "static"}}})  # node budgets
    with pytest.raises(SpecToolkitError, match="max_nodes"):
        run_config_from_dict({"speculate": {"tree": {"kind": "dynamic", "max_nodes": 64}}})
    with pytest.raises(SpecToolkitError, match="branching"):
        run_config_from_dict({"speculate": {"tree": {"kind": "static", "branching": [2, 0]}}})
