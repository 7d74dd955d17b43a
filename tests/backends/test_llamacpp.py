"""llama.cpp as a managed peer (issue 46, item 4): llama-server's command lines, which drafter each of our draft
kinds maps to, its own /completion dialect, and its speculation counters. No llama-server is needed here (the
run against a real one is tests/backends/test_llamacpp_run.py)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from spectoolkit.backends.endpoint import EndpointEngine, LoopThread, Timeouts
from spectoolkit.backends.llamacpp import find_llama_server, llamacpp_available, llamacpp_server_args
from spectoolkit.backends.managed import _llamacpp_spec_type, start_llamacpp_servers
from spectoolkit.backends.scrape import parse_spec_counters
from spectoolkit.backends.wire import LLAMACPP, LLAMACPP_NEUTRAL, OPENAI
from spectoolkit.config import DRAFT_KINDS, BackendConfig, DraftConfig, RunConfig, SamplingConfig, TargetConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.serving.api import ServeRequest
from spectoolkit.wiring.resolve import resolve_run
from tests.backends.fake_servers import MODEL, TEXT_CHUNKS, FakeOpenAIServer, expected_ids

TIMEOUTS = Timeouts(connect_s=5.0, read_s=5.0, request_s=20.0)
MAPPED = {("model", "gguf"): "draft-simple", ("ngram", None): "ngram-simple", ("none", None): None}
REFUSED = {"model": "use +draft=gguf", "suffix": "no drafter like our +draft=suffix",
           "skip": "no drafter like our +draft=skip", "eagle": "no drafter like our +draft=eagle",
           "hybrid": "no drafter like our +draft=hybrid"}  # fmt: skip


def _args(**kw) -> list[str]:
    base = {"model": "/m/t.gguf", "served_model_name": "t", "host": "127.0.0.1", "port": 8100, "threads": 2,
            "slots": 4, "ctx_per_slot": 1024}  # fmt: skip
    return llamacpp_server_args(**(base | kw))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_target_alone_has_slots_context_threads_metrics_and_no_drafter() -> None:
    args = _args()
    assert _flag(args, "-m") == "/m/t.gguf" and _flag(args, "--alias") == "t" and _flag(args, "--port") == "8100"
    assert _flag(args, "-np") == "4" and _flag(args, "-c") == "4096" and _flag(args, "-t") == "2"
    assert "--metrics" in args and "--spec-type" not in args and "-md" not in args


def test_draft_model_needs_its_type_and_draft_length() -> None:
    args = _args(spec_type="draft-simple", draft_model="/m/d.gguf", gamma=5)
    assert _flag(args, "--spec-type") == "draft-simple" and _flag(args, "-md") == "/m/d.gguf"
    assert _flag(args, "--spec-draft-n-max") == "5" and _flag(args, "-td") == "2"
    with pytest.raises(SpecToolkitError, match="needs a draft model"):
        _args(spec_type="draft-simple")


def test_ngram_modes() -> None:
    args = _args(spec_type="ngram-simple", gamma=6, ngram_max=4)
    assert _flag(args, "--spec-ngram-simple-size-n") == "4" and _flag(args, "--spec-ngram-simple-size-m") == "6"
    assert _flag(_args(spec_type="ngram-mod"), "--spec-type") == "ngram-mod"
    with pytest.raises(SpecToolkitError, match="not a llama.cpp speculative type"):
        _args(spec_type="eagle")
    assert _args(extra_args=("--spec-draft-p-min", 0.5))[-2:] == ["--spec-draft-p-min", "0.5"]


def _cfg(kind: str, precision: str | None = None, **backend) -> RunConfig:
    draft = DraftConfig(kind=kind, **({"precision": precision} if precision else {}))
    return RunConfig(draft=draft, target=TargetConfig(precision="gguf"),
                     backend=BackendConfig(kind="llamacpp", **backend))  # fmt: skip


def test_every_draft_kind_is_mapped_or_refused() -> None:
    assert {kind for kind, _ in MAPPED} | set(REFUSED) == set(DRAFT_KINDS)


@pytest.mark.parametrize("kind, precision", sorted(MAPPED, key=str))
def test_mapped_kinds(kind: str, precision: str | None) -> None:
    assert _llamacpp_spec_type(_cfg(kind, precision)) == MAPPED[kind, precision]


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_kinds_say_what_to_use(kind: str) -> None:
    with pytest.raises(SpecToolkitError, match=re.escape(REFUSED[kind])):
        _llamacpp_spec_type(_cfg(kind, "fp32" if kind == "model" else None))


def test_a_chosen_type_wins() -> None:
    assert _llamacpp_spec_type(_cfg("suffix", llamacpp_spec_type="ngram-mod")) == "ngram-mod"


def test_target_runs_at_the_files_own_precision(tmp_path) -> None:
    cfg = RunConfig(backend=BackendConfig(kind="llamacpp", llamacpp_dir=str(tmp_path)))
    with contextlib.ExitStack() as stack, pytest.raises(SpecToolkitError, match=r"add \+target=gguf"):
        start_llamacpp_servers(cfg, stack, resolve_run(cfg))


def test_missing_server_names_make_llama_cpp(tmp_path) -> None:
    with pytest.raises(SpecToolkitError, match="run `make llama-cpp`"):
        find_llama_server(tmp_path)
    assert "make llama-cpp" in (llamacpp_available(tmp_path) or "")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("#!/bin/sh\necho 'illegal instruction' >&2\nexit 132\n")
    (tmp_path / "bin" / "llama-server").chmod(0o755)
    with pytest.raises(SpecToolkitError, match="illegal instruction.*again on this machine"):
        find_llama_server(tmp_path)


# ---- llama-server's /completion dialect ---------------------------------------------------------


def test_request_switches_off_every_sampler_stage_the_run_does_not_use() -> None:
    request = ServeRequest("a", [1, 2, 3], 7, seed=11)
    body = LLAMACPP.payload(request, "m", SamplingConfig(temperature=0.7, top_p=0.9, top_k=0))
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 7 and body["seed"] == 11
    assert body["return_tokens"] and body["stream"] and body["cache_prompt"] is False
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["top_k"] == 0
    assert {key: body[key] for key in LLAMACPP_NEUTRAL} == LLAMACPP_NEUTRAL and body["min_p"] == 0.0
    assert LLAMACPP.url("http://h:1/v1") == "http://h:1/completion"
    assert OPENAI.url("http://h:1/v1") == "http://h:1/v1/completions"


def test_stop_types_read_as_finish_reasons() -> None:
    assert LLAMACPP.pieces({"content": "a", "tokens": [5], "stop": False})[0].finish_reason is None
    limit = LLAMACPP.pieces({"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 3})
    assert limit[0].finish_reason == "length" and limit[0].generated == 3 and limit[0].ids == []
    assert LLAMACPP.pieces({"stop": True, "stop_type": "eos"})[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeOpenAIServer, LoopThread]]:
    loop = LoopThread()
    with FakeOpenAIServer() as fake:
        yield fake, loop
    loop.close()


def _serve(served, mode: str, request: ServeRequest, tokenizer=None):
    fake, loop = served
    engine = EndpointEngine("t", fake.url(mode), MODEL, SamplingConfig(), TIMEOUTS, loop, tokenizer, wire=LLAMACPP)
    try:
        engine.submit(request)
        done = []
        while not done:
            done = engine.step()
        return done[0], engine
    finally:
        engine.close()


def test_native_stream_gives_one_token_per_chunk(served) -> None:
    done, engine = _serve(served, "llama", ServeRequest("a", [1, 2, 3], 5))
    assert done.error is None and done.output_ids == expected_ids([1, 2, 3], 5)
    assert len(set(done.token_times)) == 5 and not engine.ids_from_text
    assert served[0].received[-1]["n_predict"] == 5


def test_a_token_the_stream_left_out_is_respelled_from_the_text(served) -> None:
    from spectoolkit.wiring.loading import load_tokenizer

    tokenizer = load_tokenizer(None)
    done, engine = _serve(served, "llama_gap", ServeRequest("a", [1, 2], 9), tokenizer)
    assert done.error is None, done.error
    assert done.output_ids == tokenizer("".join(TEXT_CHUNKS), add_special_tokens=False).input_ids
    assert len(done.token_times) == len(done.output_ids) and engine.ids_from_text


def test_llama_server_counters_are_read_like_vllms() -> None:
    text = """# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 10
llamacpp:spec_decode_num_draft_tokens_total 40
llamacpp:spec_decode_num_accepted_tokens_total 30
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 8
llamacpp:prompt_tokens_total 99
"""
    counters = parse_spec_counters(text)
    assert counters is not None and counters.drafts == 10 and counters.draft_tokens == 40
    assert counters.accepted_tokens == 30 and counters.accepted_per_position == [9, 8]


def test_llama_cpp_is_given_the_gguf_file_behind_a_checkpoint(tmp_path) -> None:
    from spectoolkit.checkpoints import resolve_checkpoint
    from spectoolkit.embedded import embedded_dir, gguf_path

    assert resolve_checkpoint(None).gguf_file() == gguf_path() == resolve_checkpoint(str(embedded_dir())).gguf_file()
    (tmp_path / "config.json").write_text("{}")  # a float checkpoint directory: no GGUF file behind it
    with pytest.raises(SpecToolkitError, match="model.draft_path=.* is not a GGUF checkpoint"):
        resolve_checkpoint(str(tmp_path)).gguf_file("model.draft_path")
