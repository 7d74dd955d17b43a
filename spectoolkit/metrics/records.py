"""Per-request records (DESIGN §3), an append-only JSONL writer and the typed reader.

One record per request × repeat × arm. Records are appended and flushed as they are produced, so
an interrupted run keeps every finished request. Every line carries ``schema_version``
(:data:`RECORD_SCHEMA_VERSION`); a line without one is version 1, the same fields as version 2;
version 3 adds the optional serving fields (:data:`SERVING_FIELDS`), which older lines read as unset;
version 4 adds ``chosen_lengths`` (the k the draft-length policy asked for per round; empty before);
version 5 adds ``tree`` and ``tree_depths`` (token-tree arms; None/empty before and for chains).
The serving fields (``load_level`` … ``token_offsets``) are optional additions: absent in older lines.
:func:`read_records` gives back the dataclass each line was written from.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spectoolkit.metrics.tolerant import from_mapping

# 1: no schema_version key (the fields of 2); 3: + SERVING_FIELDS; 4: + chosen_lengths; 5: + tree, tree_depths
RECORD_SCHEMA_VERSION = 5
# Optional fields of serving runs (spectoolkit.bench.load), absent in batch-1 lines of any version.
SERVING_FIELDS = ("load_level", "rate", "arrival_offset", "queue_time", "tpot", "itl_p50", "itl_p99", "preemptions",
                  "mean_batch_size", "token_offsets")  # fmt: skip
Round = tuple[int, int]  # (drafted k, accepted K) of one verification round


@dataclass
class RequestRecord:
    """One generation of one request in one arm. Times in seconds; ``error`` set when it could not run."""

    case_id: str
    task_type: str
    repeat_idx: int
    arm: str  # "baseline", "spec", or an experiment's arm name ("quant", "quant+spec", "spec-g4")
    drafter: str  # "none" for the baseline arm
    target_precision: str
    draft_precision: str | None
    random_seed: int
    temperature: float
    top_p: float
    top_k: int
    draft_len: int  # γ (0 for the baseline)
    kv_target: str = "auto"  # KV-cache storage precisions (spectoolkit.kvcache)
    kv_draft: str | None = None
    batch_size: int = 1  # serving: the mean running batch over its steps, rounded (exact: mean_batch_size)
    concurrency: int = 1  # serving: the closed-loop clients, or (open loop) the mean in flight over its life, rounded
    input_len: int = 0
    output_len: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_rounds: int = 0
    rollback_count: int = 0
    proposed_rounds: int = 0
    ttft: float | None = None  # streaming: request start -> first token delivered to the on_token callback
    ttft_nonstreaming: float | None = None  # the whole response returned at once: the end-to-end time
    total_time: float | None = None
    prefill_time: float | None = None  # prompt forward + first token (both arms)
    draft_time: float | None = None  # proposer work incl. draft KV rollback
    verify_time: float | None = None  # target verify forwards (baseline: its decode steps)
    overhead_time: float | None = None  # acceptance test, KV commit, loop: total - prefill - draft - verify
    gpu_mem_peak: int | None = None  # bytes; null without an accelerator
    host_rss: int | None = None  # bytes, resident memory of this process after the request
    start_offset: float | None = None  # seconds since the measurement phase began (stability plots)
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per round
    draft_lengths: list[int] = field(default_factory=list)  # proposed drafts per round
    chosen_lengths: list[int] = field(default_factory=list)  # k the draft-length policy asked for per round (<= γ)
    tree: str | None = None  # token-tree arms: kind, shape and node budget ("static[3,2,1,1]/8"); None for chains
    tree_depths: list[int] = field(default_factory=list)  # token trees: each round's tree depth (nodes: draft_lengths)
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # Serving under load (spectoolkit.bench.load); None/empty in batch-1 runs. Times in seconds.
    load_level: str | None = None  # the level's key: "4" (closed loop, 4 clients) or "rate=0.5" (open loop)
    rate: float | None = None  # open loop: arrivals per second
    arrival_offset: float | None = None  # arrival - the level run's start
    queue_time: float | None = None  # first admitted into the running batch - arrival
    tpot: float | None = None  # (last token time - first token time) / (output_len - 1)
    itl_p50: float | None = None  # inter-token latency: gaps between distinct emission times (a step: one delivery)
    itl_p99: float | None = None
    preemptions: int | None = None  # times its KV was freed and recomputed
    mean_batch_size: float | None = None  # mean running batch over its steps (batch_size: this, rounded)
    token_offsets: list[float] = field(default_factory=list)  # [output_len] emission time of each token - arrival
    schema_version: int = RECORD_SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: Any) -> RequestRecord:
        """The record of one JSON line; unknown keys are ignored, a wrong-typed or missing field takes
        its default (None for the identifying fields without one), a line without schema_version is 1."""
        record = from_mapping(cls, raw)
        if not isinstance(raw, dict) or "schema_version" not in raw:
            record.schema_version = 1
        return record

    def rounds(self) -> list[Round]:
        """(drafted, accepted) per verify round of this request."""
        return list(zip(self.draft_lengths, self.accept_lengths, strict=False))


def rounds_of(records: list[RequestRecord]) -> list[Round]:
    """(drafted, accepted) per verify round, over ``records`` in order."""
    return [pair for record in records for pair in record.rounds()]


class RecordWriter:
    """Appends records to ``path`` (JSONL), flushing each line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_records(path: Path) -> list[RequestRecord]:
    """All complete records of a JSONL file (a torn last line from a kill, or a non-object, is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(raw, dict):
            records.append(RequestRecord.from_dict(raw))
    return records


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temporary sibling, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
