"""One job of a sweep: its identity (the resolved config), its status file, and whether to skip it.

A job is identified by the hash of its resolved configuration (every section of the run config, not
the output directory), so a re-run of the same sweep recognises finished work whatever order Hydra
numbers the jobs in. ``job.json`` in the job's directory says where the job stands::

    {"config_hash": "…", "kind": "bench", "status": "running" | "complete" | "interrupted" | "failed",
     "started": "…", "finished": "…", "seconds": 12.3, "error": null, "config": {…}}

It is written atomically when the job starts and again when it ends; a job killed outright (SIGKILL,
a cluster pre-emption) leaves ``"running"`` behind and is therefore run again. When a directory holds
a finished job of a *different* config (the sweep changed under the same overrides), everything in it
is moved to ``.superseded-<stamp>/`` first: nothing measured is ever overwritten, and the sweep's
aggregation (which skips dot-directories) sees only the current job.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from spectoolkit.metrics.records import write_json_atomic

JOB_FILE = "job.json"
COMPLETE = "complete"
# Keys of the run config that say where results go, not what is measured.
_NOT_IDENTITY = ("output_dir", "resume")


def config_hash(values: dict[str, Any]) -> str:
    """16 hex digits identifying a resolved run config (``values``: the plain dict Hydra composed)."""
    identity = {key: value for key, value in values.items() if key not in _NOT_IDENTITY}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def read_job(job_dir: Path) -> dict[str, Any] | None:
    """The job's status (``job.json``), or None when there is none or it cannot be read."""
    try:
        job = json.loads((Path(job_dir) / JOB_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return job if isinstance(job, dict) else None


def finished_before(job_dir: Path, digest: str) -> dict[str, Any] | None:
    """The job record when ``job_dir`` already holds a complete job of config ``digest``, else None."""
    job = read_job(job_dir)
    if job and job.get("status") == COMPLETE and job.get("config_hash") == digest:
        return job
    return None


def start_job(job_dir: Path, digest: str, kind: str, values: dict[str, Any]) -> dict[str, Any]:
    """Mark ``job_dir`` as running config ``digest`` (after setting aside another config's results)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    previous = read_job(job_dir)
    if previous and previous.get("config_hash") not in (None, digest):
        supersede(job_dir)
    job = {"config_hash": digest, "kind": kind, "status": "running", "started": _now(), "finished": None,
           "seconds": None, "error": None, "config": values}  # fmt: skip
    write_json_atomic(job_dir / JOB_FILE, job)
    job["_t0"] = time.perf_counter()
    return job


def end_job(job_dir: Path, job: dict[str, Any], status: str, error: str | None = None) -> None:
    """Record how the job ended: ``complete``, ``interrupted`` or ``failed`` (with the error)."""
    t0 = job.pop("_t0", None)
    job.update(status=status, finished=_now(), error=error)
    job["seconds"] = round(time.perf_counter() - t0, 3) if t0 is not None else None
    write_json_atomic(Path(job_dir) / JOB_FILE, job)


def supersede(job_dir: Path) -> Path:
    """Move everything in ``job_dir`` except Hydra's ``.hydra`` into ``.superseded-<stamp>/``."""
    job_dir = Path(job_dir)
    stamp, count = time.strftime("%Y%m%d-%H%M%S"), 1
    aside = job_dir / f".superseded-{stamp}"
    while aside.exists():
        aside, count = job_dir / f".superseded-{stamp}-{count}", count + 1
    aside.mkdir()
    for entry in job_dir.iterdir():
        if entry.name != ".hydra" and not entry.name.startswith(".superseded-"):
            entry.rename(aside / entry.name)
    return aside


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
