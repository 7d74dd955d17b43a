"""``python -m spectoolkit.train_draft``'s job (spectoolkit/training/job.py) on a tiny 6-layer checkpoint: data from the
engine on prompts past the held-out ones, a head exported where vLLM's loader reads it, cached by (checkpoint,
precision, train.*); and a run with ``+draft=eagle`` on that head is greedy-exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spectoolkit.bench.protocol.runner import run
from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.config import BenchConfig, DraftConfig, ModelConfig, RunConfig, WorkloadConfig
from spectoolkit.embedded import embedded_dir
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.eagle3_head import Eagle3Head
from spectoolkit.models.tiny import save_tiny_llama
from spectoolkit.training.job import TrainConfig, head_directory, train_config_from_dict, train_draft, with_trained_head
from tests.conftest import TINY_VOCAB_SIZE, TOKENIZER_FILES

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = save_tiny_llama(tmp_path_factory.mktemp("tiny6") / "ckpt", vocab_size=TINY_VOCAB_SIZE, num_layers=6,
                          scale=4.0)  # fmt: skip
    for name in TOKENIZER_FILES:
        if (embedded_dir() / name).is_file():
            shutil.copy(embedded_dir() / name, out / name)
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"id": f"p{i}", "task_type": "chat", "prompt": " ".join(WORDS[i:] + WORDS[:i]),
              **({"reference": " ".join(WORDS[::-1] * 3)} if i % 2 else {})} for i in range(8)]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


NO_DRAFT = DraftConfig(kind="none")


def _cfg(checkpoint: Path, out: Path, draft: DraftConfig = NO_DRAFT) -> RunConfig:
    return RunConfig(draft=draft, model=ModelConfig(target_path=str(checkpoint)), device="cpu", output_dir=str(out),
                     workload=WorkloadConfig(kind="builtin", max_new_tokens=12),
                     bench=BenchConfig(warmup=0, repeat=1, calibrate=False, baseline_check=False))  # fmt: skip


def _train_cfg(prompts_file: Path, **overrides) -> TrainConfig:
    values = dict(sources=("jsonl",), jsonl_path=str(prompts_file), prompts=5, held_out=2, answer_tokens=12,
                  concurrency=3, draft_vocab=512, steps=30, lr=3e-3, warmup=3, references=2,
                  reference_tokens=10)  # fmt: skip
    return TrainConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def trained(checkpoint, prompts_file, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECTOOLKIT_CACHE", str(cache))
        cfg = _cfg(checkpoint, tmp_path_factory.mktemp("out"))
        path = train_draft(cfg, _train_cfg(prompts_file), progress=False)
        yield cfg, path, cache, patch


def test_the_job_exports_a_head_vllm_reads_with_its_facts(trained, prompts_file):
    cfg, path, cache, _ = trained
    assert path == head_directory(cfg, _train_cfg(prompts_file), resolve_checkpoint(cfg.model.target_path))
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    head = Eagle3Head.load(path)
    ids = head.draft_to_target
    assert bool((ids[1:] > ids[:-1]).all()) and bool(head.t2d[ids].all()) and int(head.t2d.sum()) == 512
    facts = json.loads((path / "training.json").read_text())
    assert facts["prompts"] == 5 and facts["steps"] == 30 and facts["answer_tokens"] > 0
    assert facts["references"] == 2 and facts["reference_tokens"] == 20
    assert not list(cache.glob("eagle3/*.work")), "the work directory outlives a finished job"


def test_the_same_settings_reuse_the_head_and_others_train_anew(trained, checkpoint, prompts_file):
    cfg, path, _, _ = trained
    weights = (path / "model.safetensors").stat().st_mtime_ns
    assert train_draft(cfg, _train_cfg(prompts_file), progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == weights
    assert head_directory(cfg, _train_cfg(prompts_file, steps=31), resolve_checkpoint(cfg.model.target_path)) != path


def test_training_prompts_skip_the_held_out_ones(trained, prompts_file):
    from spectoolkit.training.job import training_prompts
    from spectoolkit.wiring.loading import load_tokenizer

    cfg, _, _, _ = trained
    ids = training_prompts(_train_cfg(prompts_file), load_tokenizer(cfg.model.target_path))
    tokenizer = load_tokenizer(cfg.model.target_path)
    texts = [tokenizer.decode(p) for p in ids]
    assert len(texts) == 5
    assert not any(" ".join(WORDS[i:] + WORDS[:i]) in text for text in texts for i in (0, 1))  # held out
    assert all(any(" ".join(WORDS[i:] + WORDS[:i]) in text for text in texts) for i in range(2, 7))


def test_references_are_the_training_prompts_dataset_replies_cut(trained, prompts_file):
    from spectoolkit.training.job import training_references
    from spectoolkit.wiring.loading import load_tokenizer

    cfg, _, _, _ = trained
    tokenizer = load_tokenizer(cfg.model.target_path)
    pairs = training_references(_train_cfg(prompts_file, references=9), tokenizer)
    prompts = [tokenizer.decode(p) for p, _ in pairs]
    assert len(pairs) == 3  # lines 3, 5 and 7: past the two held out, with a reply
    assert all(" ".join(WORDS[i:] + WORDS[:i]) in text for text, i in zip(prompts, (3, 5, 7), strict=True))
    reply = tokenizer.encode(" ".join(WORDS[::-1] * 3), add_special_tokens=False)
    assert all(ids == reply[:10] for _, ids in pairs)


def test_a_run_with_the_trained_head_is_greedy_exact(trained, checkpoint, tmp_path):
    _, path, _, _ = trained
    cfg = _cfg(checkpoint, tmp_path, DraftConfig(kind="eagle", eagle_path=str(path)))
    summary = run(cfg, progress=False)
    assert summary["greedy_exact_match"] == 1.0
    assert with_trained_head(cfg) is cfg  # a path given: nothing to train


def test_bad_train_settings_are_one_clear_error():
    with pytest.raises(SpecToolkitError, match="unknown train key"):
        train_config_from_dict({"stepz": 3})
    with pytest.raises(SpecToolkitError, match="train.jsonl_path"):
        TrainConfig(sources=("jsonl",))
    with pytest.raises(SpecToolkitError, match="train.sources"):
        TrainConfig(sources=("wiki",))


def test_a_serving_run_with_the_head_at_concurrency_is_greedy_exact(trained, checkpoint, tmp_path):
    """The load benchmark's engine with the head at concurrency 1 and 3 (batched head forwards), adaptive beside."""
    import dataclasses

    from spectoolkit.bench.load.runner import run_serving
    from spectoolkit.config import ServeConfig, SpeculateConfig

    _, path, _, _ = trained
    cfg = dataclasses.replace(
        _cfg(checkpoint, tmp_path, DraftConfig(kind="hybrid", eagle_path=str(path))),
        serve=ServeConfig(enabled=True, concurrency=(1, 3), warmup_requests=1),
        speculate=SpeculateConfig(policy="adaptive"),
    )
    summary = run_serving(cfg, progress=False)
    assert summary["serving_exactness"]["divergent"] == [] and summary["serving_exactness"]["checked"] > 0
    assert {arm["name"] for arm in summary["conditions"]["arms"]} >= {"baseline", "spec", "spec-adaptive"}
