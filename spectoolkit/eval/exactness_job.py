"""``python -m spectoolkit +eval=exactness``: prove to a reviewer that speculation changed nothing.

On the configured target, drafter and workload it runs, in order:

1. greedy exactness: every prompt decoded by the target alone and speculatively (greedy), each
   divergence replayed from the spec run's recorded rounds (:mod:`spectoolkit.eval.exactness`);
   the pairs are appended to ``exactness_records.jsonl`` as they are produced;
2. analytic stochastic exactness: the total variation between the distribution the verifier
   produces and the target's processed distribution at real positions (``max_tv``), with negative
   controls (:mod:`spectoolkit.eval.stochastic_analytic`; with ``speculate.tree``, at every node of
   real token trees: :mod:`spectoolkit.eval.tree_analytic`);
3. empirical stochastic exactness: seeded samples of the real sampler against the target-alone
   sampler, chi-square per position, and a negative control the test must reject
   (:mod:`spectoolkit.eval.stochastic_empirical`; trees: the control of :mod:`spectoolkit.eval.tree_empirical`);
4. what quantization cost (``quant_quality``) when the target is quantized.

``exactness.json`` (atomic) holds them all and a one-line statement. The stochastic parts use the
run's sampling, or ``eval.stochastic_temperature`` when the run is greedy.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from spectoolkit.config import RunConfig, SamplingConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.exactness_section import greedy_exactness
from spectoolkit.eval.quality_section import quant_quality
from spectoolkit.eval.stochastic_analytic import analytic_exactness
from spectoolkit.eval.stochastic_empirical import engine_exactness, negative_control
from spectoolkit.eval.tree_analytic import tree_analytic_exactness
from spectoolkit.eval.tree_empirical import tree_negative_control
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.metrics.records import RequestRecord, write_json_atomic
from spectoolkit.policy import draft_depth, make_policy
from spectoolkit.wiring.one_engine import OneEngines
from spectoolkit.wiring.setup import ArmSet, LoadedModels, build, shared_vocab_size
from spectoolkit.workloads.prompts import encode_prompt, load_workload

RESULT_FILE = "exactness.json"
PAIRS_FILE = "exactness_records.jsonl"
VERDICTS = {
    True: "speculation added nothing",
    False: "SPECULATION CHANGED THE OUTPUT — see exactness.json",
    None: "speculation added nothing detectable, but a check was inconclusive (see below)",
}
NGRAM_SCAN = 8  # n-gram lookup proposes at few sampled positions: scan this many more to find some


def run_exactness_job(cfg: RunConfig) -> str:
    """Run every exactness check for ``cfg``, write exactness.json; returns the text to print."""
    if cfg.draft.kind == "none":
        raise SpecToolkitError("+eval=exactness checks a drafter against the target: set +draft=<precision|ngram>")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    greedy_cfg = replace(
        cfg, sampling=replace(cfg.sampling, temperature=0.0), bench=replace(cfg.bench, arms="standard")
    )
    setup = build(greedy_cfg)
    models, arm_set = setup.models, setup.arm_set
    prompts = _prompts(cfg, models)
    sampling = (
        cfg.sampling if not cfg.sampling.greedy else replace(cfg.sampling, temperature=cfg.eval.stochastic_temperature)
    )
    result: dict[str, Any] = {"complete": False, "sampling": vars(sampling)}
    result["greedy"], context = _greedy(cfg, arm_set, prompts, out_dir / PAIRS_FILE)
    write_json_atomic(out_dir / RESULT_FILE, result)  # what is finished is kept if a later part fails
    analytic = _analytic(cfg, models, prompts, sampling)
    result.update(max_tv=analytic["max_tv"], analytic=analytic)
    write_json_atomic(out_dir / RESULT_FILE, result)
    result["empirical"] = _empirical(cfg, models, context, sampling)
    result["quant_quality"] = quant_quality(cfg, models)
    result["passed"] = _passed(result)
    result.update(statement=statement(result), complete=True)
    write_json_atomic(out_dir / RESULT_FILE, result)
    return result["statement"] + f"\nwritten: {out_dir / RESULT_FILE}"


def _prompts(cfg: RunConfig, models: LoadedModels) -> dict[str, list[int]]:
    """case_id -> prompt ids of the workload's runnable requests (bad lines are skipped here)."""
    prompts = {}
    for request in load_workload(cfg.workload):
        ids = [] if request.error else encode_prompt(models.tokenizer, request, cfg.workload.chat_template)
        if ids and len(ids) + cfg.workload.max_new_tokens <= models.max_positions:
            prompts[request.case_id] = ids
    if not prompts:
        raise SpecToolkitError("the workload has no runnable prompt: check workload.path / workload.max_new_tokens")
    return prompts


def _greedy(cfg: RunConfig, arm_set: ArmSet, prompts: dict[str, list[int]], pairs_path: Path):
    """(exactness section, empirical context): the context is the prompt + half the reference output
    of the case where the drafter had the most tokens accepted, so the sampling test sees drafts."""
    records, best = [], (-1, [])
    with pairs_path.open("a", encoding="utf-8") as pairs:
        for case_id, ids in prompts.items():
            for arm in arm_set.arms:
                out = arm.engine.generate(ids, cfg.workload.max_new_tokens, None)
                # the rounds (draft/accept lengths) are what a divergence is replayed from
                pair = {"arm": arm.name, "case_id": case_id, "repeat_idx": 0, "output_ids": out.output_ids,
                        "accepted_tokens": out.accepted_tokens, "draft_lengths": out.draft_lengths,
                        "accept_lengths": out.accept_lengths}  # fmt: skip
                pairs.write(json.dumps(pair) + "\n")
                pairs.flush()
                records.append(RequestRecord.from_dict(pair))
            reference = records[-len(arm_set.arms)].output_ids
            if out.accepted_tokens > best[0]:
                best = (out.accepted_tokens, ids + reference[: len(reference) // 2])
    return greedy_exactness(records, arm_set, prompts, cfg.kv.target), best[1]


def _analytic(cfg: RunConfig, models: LoadedModels, prompts: dict[str, list[int]], sampling: SamplingConfig) -> dict:
    target, draft = models.target, models.draft
    if cfg.speculate.tree.enabled:  # the rounds verify token trees: check the tree rule at every node
        return tree_analytic_exactness(
            target.model, draft.model if draft else None, list(prompts.values()), sampling, cfg.speculate.tree,
            cfg.eval.analytic_positions * (NGRAM_SCAN if draft is None else 1), cfg.sampling.seed,
            gamma=cfg.speculate.gamma, draft_vocab_shared=shared_vocab_size(target, draft) if draft else None,
            ngram_max=cfg.draft.ngram_max, ngram_min=cfg.draft.ngram_min,
        )  # fmt: skip
    return analytic_exactness(
        target.model, draft.model if draft else None, list(prompts.values()), sampling,
        cfg.eval.analytic_positions * (NGRAM_SCAN if draft is None else 1), cfg.sampling.seed,
        draft_vocab_shared=shared_vocab_size(target, draft) if draft else None,
        ngram_max=cfg.draft.ngram_max, ngram_min=cfg.draft.ngram_min,
    )  # fmt: skip


def _empirical(cfg: RunConfig, models: LoadedModels, prompt: list[int], sampling: SamplingConfig) -> dict:
    """Chi-square of the target alone vs the speculative sampler and its negative control, on the one engine."""
    control_of = tree_negative_control if cfg.speculate.tree.enabled else negative_control
    tree, model = cfg.speculate.tree, models.target.model
    one = OneEngines(replace(cfg, sampling=sampling), models, make_verifier(sampling, models.device))
    spec, real = one.drafting("spec", model, make_policy(cfg.speculate), tree)
    control, _ = one.drafting("control", model, make_policy(cfg.speculate), tree, control_of(real, sampling))
    engines = {"baseline": one.target_alone("baseline", model), "spec": spec, "control": control}
    return engine_exactness(engines.__getitem__, prompt, cfg.eval.samples, _length(cfg), cfg.sampling.seed,
                            cfg.eval.significance, tree)  # fmt: skip


def _length(cfg: RunConfig) -> int:
    """Output positions compared: ``eval.length``, or room for a whole tree after the first token (else only
    shallow trees are tested)."""
    if not cfg.speculate.tree.enabled:
        return cfg.eval.length
    return max(cfg.eval.length, draft_depth(cfg.speculate) + 2)


def _passed(result: dict[str, Any]) -> bool | None:
    """False when a check found a change (unexplained greedy divergence, TV above threshold, sampling
    test rejected); None when none did but one could not show anything (no scored position, or a
    negative control the sampling test did not reject); True otherwise."""
    analytic, empirical = result["analytic"], result["empirical"]
    changed = (not result["greedy"]["passed"] or (analytic["positions"] and not analytic["passed"])
               or empirical["rejected"])  # fmt: skip
    if changed:
        return False
    return True if analytic["positions"] and empirical["power_shown"] else None


def statement(result: dict[str, Any]) -> str:
    """ "quantization cost X; speculation added nothing" — or what it added."""
    greedy, analytic, empirical = result["greedy"], result["analytic"], result["empirical"]
    quality = result.get("quant_quality")
    cost = "no quantization cost measured (float target)"
    if isinstance(quality, dict) and "kl_mean" in quality:
        cost = (f"quantization cost (vs {quality['reference']}): KL {quality['kl_mean']:.4f}, top-1 agreement "
                f"{quality['top1_agreement']:.1%}, perplexity {quality['ppl_delta']:+.3f}")  # fmt: skip
    verdict = VERDICTS[result["passed"]]
    evidence = (
        f"greedy: {greedy['verdict']} ({greedy['identical']}/{greedy['pairs']} identical, {greedy['near_ties']} "
        f"near-tie, {greedy['unexplained']} unexplained); analytic max TV {analytic['max_tv']:.2e} over "
        f"{analytic['positions']} positions (controls: "
        + ", ".join(f"{name} {c['max_tv']:.3f}" for name, c in analytic["controls"].items())
        + f"); empirical min p {empirical['min_p_value']:.3g} (control p {empirical['control']['min_p_value']:.2g}, "
        f"{'rejected' if empirical['power_shown'] else 'NOT rejected: no power here'}; acceptance "
        f"{_rate(empirical.get('acceptance_rate'))})"
    )
    return f"{cost}; {verdict}.\n{evidence}"


def _rate(value: float | None) -> str:
    return "n/a (nothing drafted)" if value is None else f"{value:.2f}"
