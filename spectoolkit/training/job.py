"""``python -m spectoolkit.train_draft``: an EAGLE-3 draft head for a run's target, trained here and cached.

1. **Data.** Training prompts come from ``train.sources`` (HumanEval, ShareGPT, a JSONL file), skipping the
   first ``train.held_out`` of each — the prompts a run measures on come first, so they are never trained on.
   The target answers ``train.prompts`` of them greedily (chat template) on the one engine,
   ``train.concurrency`` at a time; ``train.references`` of them (none by default) also come with the
   dataset's own reply (ShareGPT's, HumanEval's canonical solution), which costs no generation. One target
   forward per sequence reads its states and next-token distribution (:mod:`~spectoolkit.training.data`).
2. **Vocabulary.** The ``train.draft_vocab`` most frequent target ids of the sequences; the head's
   output rows start as the target's embedding rows of those ids (a tied-head target's own head).
3. **Training** (:mod:`~spectoolkit.training.loop`): ``train.steps`` steps with a progress bar; the answers
   and checkpoints live in a work directory beside the cache entry, so an interrupted job resumes.
4. **Export.** The finished head is written once, in vLLM's eagle3 layout, to
   ``cache_root()/eagle3/<target>-<hash>``: the hash covers the target checkpoint (path, weight files), its
   precision and every ``train.*`` setting, so the same command reuses it and another setting trains anew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch

from spectoolkit.checkpoints import Checkpoint, checkpoint_identity
from spectoolkit.config import DraftConfig, RunConfig, _number, _require, drafter_kinds
from spectoolkit.embedded import cache_root, cached_directory
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.eagle3_head import WEIGHTS_FILE, Eagle3Head, HeadShape, draft_vocabulary
from spectoolkit.precisions import precision_label, resolve_activations
from spectoolkit.training.data import output_rows, target_sequence
from spectoolkit.training.loop import TrainSettings, train
from spectoolkit.wiring.resolve import ResolvedRun, resolve_run
from spectoolkit.workloads.prompts import encode_prompt, iter_requests

SOURCES = ("humaneval", "sharegpt", "jsonl")
JOB_VERSION = 2  # bump when the data or the recipe changes: it is part of the cache key
ANSWERS_FILE = "answers.json"


@dataclass(frozen=True)
class TrainConfig:
    """The ``train/`` group: where the data comes from, the head's size and the recipe."""

    sources: tuple[str, ...] = ("humaneval", "sharegpt")
    jsonl_path: str | None = None  # sources containing jsonl: the file ({"id", "task_type", "prompt", "reference"})
    prompts: int = 1024  # training prompts per source the target answers (HumanEval has 100 after held_out)
    references: int = 0  # training prompts per source taken with the dataset's reply (those that have one)
    reference_tokens: int = 384  # a reference reply is cut to this many tokens
    held_out: int = 64  # the first prompts of each source, never trained on (runs measure the first ones)
    max_prompt_tokens: int = 512  # longer prompts are skipped
    answer_tokens: int = 128  # the target's greedy answer, at most
    concurrency: int = 16  # answers generated at once on the engine
    draft_vocab: int = 16384
    steps: int = 2400
    prompt_loss: bool = True  # the loss counts the prompts' positions too (the target's predictions there)
    lr: float = 5e-4
    warmup: int = 30
    ttt_steps: int = 3  # draft steps unrolled per anchor (training-time test)
    seed: int = 0
    out: str | None = None  # also copy the export here

    def __post_init__(self) -> None:
        sources = tuple(self.sources) if isinstance(self.sources, (list, tuple)) else (self.sources,)
        object.__setattr__(self, "sources", sources)
        _require(bool(sources) and all(s in SOURCES for s in sources),
                 f"train.sources={list(sources)} must be a non-empty list of {', '.join(SOURCES)}")  # fmt: skip
        _require("jsonl" not in sources or bool(self.jsonl_path), "train.sources has jsonl: set train.jsonl_path")
        positive = ("prompts", "reference_tokens", "max_prompt_tokens", "answer_tokens", "concurrency", "draft_vocab",
                    "steps", "ttt_steps")  # fmt: skip
        for key, least in [*((key, 1) for key in positive), ("held_out", 0), ("references", 0)]:
            value = getattr(self, key)
            _require(_number(value, int) and value >= least, f"train.{key}={value!r} must be an integer >= {least}")
        _require(_number(self.lr, (int, float)) and self.lr > 0, f"train.lr={self.lr} must be > 0")

    def settings(self) -> TrainSettings:
        return TrainSettings(steps=self.steps, lr=self.lr, warmup=min(self.warmup, self.steps),
                             ttt_steps=self.ttt_steps, seed=self.seed, save_every=100)  # fmt: skip

    def key(self) -> dict:
        """What the trained head depends on (``out`` is only where a copy goes)."""
        return {name: value for name, value in asdict(self).items() if name != "out"}


def train_config_from_dict(values: dict | None) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values or {}) - fields)
    if unknown:
        raise SpecToolkitError(f"unknown train key(s) {unknown}: choose from {sorted(fields)}")
    return TrainConfig(**(values or {}))


def head_directory(cfg: RunConfig, train_cfg: TrainConfig, target: Checkpoint) -> Path:
    """Where the head of (``cfg``'s target, resolved once as ``target``; ``train_cfg``) is cached."""
    source = target.directory()
    label = precision_label(cfg.target.precision, resolve_activations(cfg.target.precision, cfg.target.activations))
    identity = {**checkpoint_identity(source), "precision": cfg.target.precision,
                "group_size": cfg.target.group_size, "train": train_cfg.key(), "version": JOB_VERSION}  # fmt: skip
    if label != cfg.target.precision:  # int8 activations: the states the head learns from differ (float keeps old keys)
        identity["label"] = label
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "eagle3" / f"{source.name}-{label}-{digest}"


def train_draft(cfg: RunConfig, train_cfg: TrainConfig, progress: bool = True) -> Path:
    """The trained head's directory for ``cfg``'s target: cached, else trained now (resuming a broken job)."""
    cfg = dataclasses.replace(cfg, draft=DraftConfig(kind="none"))  # the target alone labels the data
    run = resolve_run(cfg)  # once: the cache key and the target the job loads
    target_dir = head_directory(cfg, train_cfg, run.target)
    work = target_dir.with_name(target_dir.name + ".work")
    out = cached_directory(target_dir, WEIGHTS_FILE, lambda tmp: _build(cfg, run, train_cfg, work, tmp, progress))
    shutil.rmtree(work, ignore_errors=True)
    if train_cfg.out:
        shutil.copytree(out, Path(train_cfg.out).expanduser(), dirs_exist_ok=True)
    return out


def with_trained_head(cfg: RunConfig, progress: bool = True) -> RunConfig:
    """``cfg`` with ``draft.eagle_path`` set where a head drafts (``+draft=eagle``/``hybrid``, or such an arm of
    ``bench.arms=drafters``) and no path is given: the default head, trained now or reused from the cache."""
    if cfg.draft.eagle_path or "eagle" not in drafter_kinds(cfg):
        return cfg
    path = train_draft(cfg, TrainConfig(), progress)
    return dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, eagle_path=str(path)))


def _build(cfg: RunConfig, run: ResolvedRun, train_cfg: TrainConfig, work: Path, out: Path, progress: bool) -> None:
    from spectoolkit.wiring.setup import build, frozen_heap  # the target as a run loads it (precision, packing)

    setup = build(cfg, arms=False, run=run)
    models = setup.models
    began = time.perf_counter()
    with frozen_heap():
        pairs = _answers(cfg, train_cfg, setup, work, progress)
    references = training_references(train_cfg, models.tokenizer)
    model = models.target.model
    labelled = [(p, a) for p, a in pairs + references if a]  # an empty answer or reply has nothing to learn
    texts = [p + a for p, a in labelled]
    draft_ids = draft_vocabulary(texts, train_cfg.draft_vocab, models.target.vocab_size)
    shape = HeadShape.of_target(model.config, train_cfg.draft_vocab)
    rows = output_rows(model, draft_ids)
    bar = _bar(len(labelled), progress, "labels")
    sequences = []
    for index, (p, a) in enumerate(labelled):
        sequences.append(target_sequence(model, p, a, shape.aux_layers, draft_ids, train_cfg.prompt_loss, rows))
        bar(index, None)
    bar(None, None)
    data_seconds = time.perf_counter() - began
    embeddings = model.get_input_embeddings().weight.detach().float()
    torch.manual_seed(train_cfg.seed)
    head = Eagle3Head(shape, draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(embeddings[draft_ids])
    bar = _bar(train_cfg.steps, progress)
    began = time.perf_counter()
    losses = train(head, embeddings, sequences, train_cfg.settings(), work, on_step=lambda step, loss: bar(step, loss))
    bar(None, None)
    head.save(out)
    facts = {"prompts": len(pairs), "answer_tokens": sum(len(a) for _, a in pairs),
             "references": len(references), "reference_tokens": sum(len(a) for _, a in references),
             "tokens": sum(len(t) for t in texts), "data_seconds": round(data_seconds, 1),
             "train_seconds": round(time.perf_counter() - began, 1), "steps": train_cfg.steps,
             "final_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4) if losses else None,
             "train": train_cfg.key(), "target_precision": cfg.target.precision,
             "target_activations": resolve_activations(cfg.target.precision, cfg.target.activations)}  # fmt: skip
    (out / "training.json").write_text(json.dumps(facts, indent=2), encoding="utf-8")


def training_prompts(train_cfg: TrainConfig, tokenizer) -> list[list[int]]:
    """Token ids of the prompts the target answers: per source, ``prompts`` of them after the first ``held_out``,
    each at most ``max_prompt_tokens`` long (longer ones are skipped, not cut)."""
    return [ids for source in train_cfg.sources
            for ids, _ in islice(_training_requests(train_cfg, tokenizer, source), train_cfg.prompts)]  # fmt: skip


def training_references(train_cfg: TrainConfig, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt, reference reply) token ids: per source, the first ``references`` training prompts that have a
    dataset reply, the reply cut to ``reference_tokens``."""
    out = []
    for source in train_cfg.sources:
        replies = ((ids, request.reference) for ids, request in _training_requests(train_cfg, tokenizer, source)
                   if request.reference)  # fmt: skip
        for ids, reply in islice(replies, train_cfg.references):
            out.append((ids, tokenizer.encode(reply, add_special_tokens=False)[: train_cfg.reference_tokens]))
    return out


def _training_requests(train_cfg: TrainConfig, tokenizer, source: str):
    """(prompt ids, request) of ``source`` after its first ``held_out``, prompts of at most ``max_prompt_tokens``."""
    for request in islice(iter_requests(source, train_cfg.jsonl_path), train_cfg.held_out, None):
        ids = encode_prompt(tokenizer, request, True)
        if len(ids) <= train_cfg.max_prompt_tokens:
            yield ids, request


def _answers(cfg: RunConfig, train_cfg: TrainConfig, setup, work: Path, progress: bool) -> list[tuple[list, list]]:
    """(prompt, greedy answer) pairs, generated on the engine once and kept in ``work`` for a resumed job."""
    path = work / ANSWERS_FILE
    if path.is_file():
        return [(p, a) for p, a in json.loads(path.read_text(encoding="utf-8"))]
    prompts = training_prompts(train_cfg, setup.models.tokenizer)
    if not prompts:
        raise SpecToolkitError("no training prompts: lower train.held_out or raise train.max_prompt_tokens")
    answers = generate_answers(cfg, setup, prompts, train_cfg.answer_tokens, train_cfg.concurrency, progress)
    pairs = list(zip(prompts, answers, strict=True))
    work.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pairs), encoding="utf-8")
    tmp.replace(path)
    return pairs


def generate_answers(cfg: RunConfig, setup, prompts: list[list[int]], max_new: int, concurrency: int,
                     progress: bool) -> list[list[int]]:  # fmt: skip
    """The target's greedy answers to ``prompts`` on the continuous-batching engine, ``concurrency`` at a time
    (``setup``: the loaded models, :func:`~spectoolkit.wiring.setup.build`)."""
    from spectoolkit.serving.api import ServeRequest
    from spectoolkit.serving.assemble import served_arm

    serve = dataclasses.replace(cfg.serve, concurrency=(concurrency,), max_num_seqs=concurrency)
    greedy = dataclasses.replace(cfg.sampling, temperature=0.0)
    run = dataclasses.replace(cfg, serve=serve, sampling=greedy, draft=DraftConfig(kind="none"))
    engine = served_arm(run, setup).engine
    eos_ids = setup.models.eos_ids
    pending = list(enumerate(prompts))[::-1]
    answers: dict[int, list[int]] = {}
    bar = _bar(len(prompts), progress, "answers")
    while pending or engine.has_work():
        while pending and len(engine.scheduler.running) + len(engine.scheduler.queue) < concurrency:
            index, ids = pending.pop()
            engine.submit(ServeRequest(str(index), ids, max_new))
        for done in engine.step():
            if done.error:
                raise SpecToolkitError(f"training prompt {done.request_id}: {done.error}")
            answers[int(done.request_id)] = [t for t in done.output_ids if t not in eos_ids]
            bar(len(answers) - 1, None)
    bar(None, None)
    return [answers[i] for i in range(len(prompts))]


def _bar(total: int, shown: bool, what: str = "steps"):
    """A progress callback ``(done index, loss)``; ``(None, None)`` closes it."""
    if not shown:
        return lambda index, loss: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"train_draft {what}", file=sys.stderr, dynamic_ncols=True)

    def update(index, loss):
        if index is None:
            bar.close()
            return
        bar.n = index + 1
        if loss is not None:
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.refresh()

    return update
