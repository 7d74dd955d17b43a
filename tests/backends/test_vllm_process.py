"""vLLM server command lines and the managed server process (spectoolkit.backends.vllm, issue 17).

The process tests run tiny stand-in servers (``python -c``): healthy after a delay, exiting at once,
never healthy, or with a group member that ignores SIGTERM. The slow test starts the real vLLM
baseline server on the embedded model from ``.venv-vllm`` (``make vllm``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from spectoolkit.backends import process as process_backend
from spectoolkit.backends.process import ManagedServer
from spectoolkit.backends.vllm import (
    find_vllm_python,
    vllm_available,
    vllm_command,
    vllm_env,
    vllm_server_args,
)
from spectoolkit.errors import SpecToolkitError

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _checkpoint(path: Path, config: dict, quantize_config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if quantize_config is not None:
        (path / "quantize_config.json").write_text(json.dumps(quantize_config), encoding="utf-8")
    return path


def _args(role: str = "spec", **overrides) -> list[str]:
    inputs = {"model_dir": "/m/target", "served_model_name": "smol", "host": "127.0.0.1", "port": 8100}
    return vllm_server_args(role, **(inputs | overrides))


def _spec(args: list[str]) -> dict:
    return json.loads(args[args.index("--speculative-config") + 1])


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- vllm_server_args ---------------------------------------------------------------------------


def test_baseline_args_have_no_speculation_and_keep_extra_args_last():
    args = _args("baseline", dtype="fp32", max_model_len=2048, drafter="eagle", extra_args=["--enforce-eager"])
    assert "--speculative-config" not in args  # the drafter is the spec server's only
    assert _flag(args, "--model") == "/m/target" and _flag(args, "--served-model-name") == "smol"
    assert (_flag(args, "--host"), _flag(args, "--port")) == ("127.0.0.1", "8100")
    assert (_flag(args, "--dtype"), _flag(args, "--max-model-len")) == ("float32", "2048")
    assert "--no-enable-prefix-caching" in args and args[-1] == "--enforce-eager"
    assert "--no-enable-prefix-caching" not in _args("baseline", prefix_caching=True)


def test_ngram_spec_config():
    args = _args(gamma=5, drafter="ngram", ngram_max=4, ngram_min=1)
    assert _spec(args) == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }


def test_model_drafter_self_draft_and_given_draft(tmp_path):
    assert _spec(_args(drafter="model", gamma=3)) == {
        "method": "draft_model",
        "model": "/m/target",
        "num_speculative_tokens": 3,
    }
    assert _spec(_args(drafter="model", draft_model_dir=tmp_path))["model"] == str(tmp_path)


def test_float_draft_precision_must_be_the_target_dtype(tmp_path):
    assert "quantization" not in _spec(_args(dtype="fp32", drafter="model", draft_precision="fp32"))
    assert "quantization" not in _spec(_args(dtype="bfloat16", drafter="model", draft_precision="bf16"))
    with pytest.raises(SpecToolkitError, match=r"target's dtype \(float16\)"):
        _args(dtype="fp16", drafter="model", draft_precision="fp32")
    half = _checkpoint(tmp_path / "half", {"dtype": "bfloat16"})  # auto keeps a half-precision checkpoint's dtype
    assert "quantization" not in _spec(_args(model_dir=half, drafter="model", draft_precision="bf16"))
    with pytest.raises(SpecToolkitError, match=r"target's dtype \(bfloat16\)"):
        _args(model_dir=half, drafter="model", draft_precision="fp32")
    full = _checkpoint(tmp_path / "full", {"dtype": "float32"})  # auto may downcast it: vLLM's choice
    with pytest.raises(SpecToolkitError, match="set the target's dtype"):
        _args(model_dir=full, drafter="model", draft_precision="fp32")
    assert _spec(_args(model_dir=full, drafter="model"))["model"] == str(full)  # no precision asked: no check


def test_int4_draft_needs_a_symmetric_gptq_checkpoint_and_a_half_precision_target(tmp_path):
    sym = _checkpoint(tmp_path / "sym", {"quantization_config": {"quant_method": "gptq", "bits": 4, "sym": True}})
    int4 = {"drafter": "model", "draft_precision": "int4", "dtype": "bf16"}
    assert _spec(_args(draft_model_dir=sym, **int4))["quantization"] == "gptq"
    old_style = _checkpoint(tmp_path / "old", {}, quantize_config={"bits": 4, "sym": True})
    assert _spec(_args(draft_model_dir=old_style, **(int4 | {"dtype": "fp16"})))["quantization"] == "gptq"
    with pytest.raises(SpecToolkitError, match=r"target's dtype \(float32\), and GPTQ needs bf16 or fp16"):
        _args(draft_model_dir=sym, **(int4 | {"dtype": "fp32"}))
    asym = _checkpoint(tmp_path / "asym", {"quantization_config": {"quant_method": "gptq", "bits": 4, "sym": False}})
    with pytest.raises(SpecToolkitError, match="sym=true"):
        _args(draft_model_dir=asym, **int4)
    plain = _checkpoint(tmp_path / "plain", {"dtype": "float32"})
    with pytest.raises(SpecToolkitError, match="needs a GPTQ checkpoint"):
        _args(draft_model_dir=plain, **int4)


@pytest.mark.parametrize("precision", ["int8", "nf4", "rtn-int8", "rtn-int4"])
def test_draft_precisions_vllm_cannot_load(precision):
    with pytest.raises(SpecToolkitError, match=f"draft.precision={precision} cannot run on vLLM"):
        _args(drafter="model", draft_precision=precision)


def test_draft_precision_is_ignored_without_a_draft_model():
    assert _spec(_args(drafter="ngram", draft_precision="nf4"))["method"] == "ngram"


def test_eagle_drafter_method_from_the_checkpoint(tmp_path):
    eagle = _checkpoint(tmp_path / "head", {"architectures": ["LlamaForCausalLM"]})
    assert _spec(_args(drafter="eagle", eagle_dir=eagle, gamma=2)) == {
        "method": "eagle",
        "model": str(eagle),
        "num_speculative_tokens": 2,
    }
    eagle3 = _checkpoint(tmp_path / "head3", {"architectures": ["LlamaForCausalLMEagle3"]})
    assert _spec(_args(drafter="eagle", eagle_dir=eagle3))["method"] == "eagle3"
    with pytest.raises(SpecToolkitError, match="backend.eagle_path"):
        _args(drafter="eagle")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gamma": 0}, "gamma >= 1"),
        ({"ngram_min": 3, "ngram_max": 2}, "draft.ngram_min=3"),
        ({"drafter": "medusa"}, "no vLLM equivalent"),
        ({"dtype": "int8"}, "not a vLLM --dtype"),
        ({"drafter": "model", "draft_precision": "fp8"}, "not a precision vLLM"),
    ],
)
def test_unsupported_inputs_raise_one_error(overrides, message):
    with pytest.raises(SpecToolkitError, match=message):
        _args(**overrides)


def test_unknown_role():
    with pytest.raises(SpecToolkitError, match="role 'draft'"):
        _args("draft")


def test_command_and_env():
    assert vllm_command("/v/bin/python", ["--port", "1"]) == [
        "/v/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--port",
        "1",
    ]
    env = vllm_env(1, omp_threads_bind="1")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env()
    with pytest.raises(SpecToolkitError, match="vllm_kv_cache_gib"):
        vllm_env(0)


# ---- find_vllm_python / vllm_available ----------------------------------------------------------


def test_missing_vllm_env_says_make_vllm(tmp_path):
    with pytest.raises(SpecToolkitError, match=r"run `make vllm`") as error:
        find_vllm_python(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(error.value)
    assert "make vllm" in (vllm_available(tmp_path / "nope") or "")


def test_a_venv_without_vllm_is_not_available(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)  # our python: no vllm package in it
    reason = vllm_available(tmp_path)
    assert reason is not None and "has no vllm package" in reason


# ---- ManagedServer ------------------------------------------------------------------------------

HEALTHY_AFTER = textwrap.dedent(
    """
    import http.server, sys, time
    port, delay = int(sys.argv[1]), float(sys.argv[2])
    print("fake server starting", flush=True)
    time.sleep(delay)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)
EXITS = "import sys; print('loading'); print('boom: no such model', flush=True); sys.exit(3)"
# vLLM's shape of failure: the root cause in a worker's log line, then pages of traceback from the others.
ROOT_CAUSE_FIRST = (
    "import sys; print('(Worker pid=7) ERROR [executor.py:9] pydantic_core.ValidationError: 1 validation error'); "
    "print('  Value error, torch.float32 is not supported'); [print('  traceback line', i) for i in range(60)]; "
    "print('RuntimeError: Engine core initialization failed.', flush=True); sys.exit(1)"
)
NEVER_HEALTHY = "import time; print('compiling', flush=True); time.sleep(60)"
# Prepended to HEALTHY_AFTER: a child in the group that ignores SIGTERM (stop must escalate to SIGKILL).
STUBBORN_CHILD = textwrap.dedent(
    """
    import subprocess, sys
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()  # its SIGTERM handler is in place
    print("child", stubborn.pid, flush=True)
    """
)


def _server(tmp_path: Path, code: str, *args: str, host: str = "127.0.0.1") -> ManagedServer:
    port = _free_port()
    command = [sys.executable, "-c", code, str(port), *args]
    return ManagedServer(command, host=host, port=port, log_path=tmp_path / "logs" / "server.log", name="fake")


def _group_gone(pgid: int) -> bool:
    return not process_backend._group_alive(pgid)


def test_healthy_server_then_stop_leaves_no_process(tmp_path):
    with _server(tmp_path, HEALTHY_AFTER, "0.3") as server:
        assert server.running()
        server.wait_healthy(20)
        with urllib.request.urlopen(f"{server.root_url}/health", timeout=2) as response:
            assert response.status == 200
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        pgid = server.pid
    assert pgid is not None and _group_gone(pgid) and not server.running()
    assert "fake server starting" in server.log_tail()
    server.stop()  # idempotent


def test_server_that_exits_fails_early_with_its_log(tmp_path):
    server = _server(tmp_path, EXITS)
    server.start()
    started = time.monotonic()
    with pytest.raises(SpecToolkitError, match="exited with code 3") as error:
        server.wait_healthy(30)
    assert time.monotonic() - started < 10  # not the whole timeout
    assert "boom: no such model" in str(error.value) and "loading" in str(error.value)
    assert not server.running()


def test_an_early_exit_names_the_first_exception_beyond_the_tail(tmp_path):
    server = _server(tmp_path, ROOT_CAUSE_FIRST)
    server.start()
    with pytest.raises(SpecToolkitError, match="exited with code 1") as error:
        server.wait_healthy(30)
    message = str(error.value)
    assert "first error:" in message and "torch.float32 is not supported" in message
    assert "traceback line 59" in message and "traceback line 20" not in message  # the tail: last 30 lines


def test_server_never_healthy_times_out_naming_the_setting_and_is_stopped(tmp_path):
    server = _server(tmp_path, NEVER_HEALTHY)
    server.start()
    pgid = server.pid
    with pytest.raises(SpecToolkitError, match=r"after 1 s: raise backend.startup_timeout_s") as error:
        server.wait_healthy(1.0)
    assert "compiling" in str(error.value)
    assert pgid is not None and _group_gone(pgid)


def test_stop_kills_a_group_member_that_ignores_sigterm(tmp_path):
    server = _server(tmp_path, STUBBORN_CHILD + HEALTHY_AFTER, "0")
    server.start()
    server.wait_healthy(20)
    child_line = next(line for line in server.log_tail().splitlines() if line.startswith("child "))
    child = int(child_line.split()[1])
    pgid = server.pid
    assert pgid is not None and os.getpgid(child) == pgid
    started = time.monotonic()
    server.stop(timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert _group_gone(pgid)


def test_interrupt_while_waiting_stops_the_server(tmp_path, monkeypatch):
    server = _server(tmp_path, NEVER_HEALTHY)
    server.start()
    pgid = server.pid

    def interrupted(self, timeout_s):
        raise KeyboardInterrupt

    monkeypatch.setattr(ManagedServer, "_healthy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.wait_healthy(30)
    assert pgid is not None and _group_gone(pgid)


def test_context_manager_stops_on_an_error_inside(tmp_path):
    with pytest.raises(RuntimeError, match="inside"):
        with _server(tmp_path, NEVER_HEALTHY) as server:
            pgid = server.pid
            raise RuntimeError("inside")
    assert pgid is not None and _group_gone(pgid)


def test_only_loopback_hosts_unless_allowed(tmp_path):
    with pytest.raises(SpecToolkitError, match="backend.allow_remote"):
        ManagedServer(["true"], host="10.1.2.3", port=8000, log_path=tmp_path / "log")
    remote = ManagedServer(["true"], host="10.1.2.3", port=8000, log_path=tmp_path / "log", allow_remote=True)
    assert remote.base_url == "http://10.1.2.3:8000/v1"
    assert ManagedServer(["true"], host="::1", port=8000, log_path=tmp_path / "log").base_url == "http://[::1]:8000/v1"


def test_a_command_that_cannot_start_is_a_user_error(tmp_path):
    server = ManagedServer([str(tmp_path / "no-python")], host="127.0.0.1", port=1, log_path=tmp_path / "log")
    with pytest.raises(SpecToolkitError, match="cannot start"):
        server.start()
    assert not server.running()


# ---- the real vLLM server -----------------------------------------------------------------------


@pytest.mark.slow
def test_real_vllm_baseline_server_serves_a_greedy_completion(tmp_path):
    reason = vllm_available(VLLM_VENV)
    if reason is not None:
        pytest.skip(reason)
    from spectoolkit.embedded import embedded_dir

    model_dir, port = embedded_dir(), _free_port()
    args = vllm_server_args(
        "baseline", model_dir=model_dir, served_model_name="smol", host="127.0.0.1", port=port, dtype="fp32",
        max_model_len=512, extra_args=["--enforce-eager"],  # eager: no minutes of torch.compile at start
    )  # fmt: skip
    command = vllm_command(find_vllm_python(VLLM_VENV), args)
    prompt_ids = [
        504,
        2365,
        6354,
        16438,
        27003,
        690,
        260,
        23790,
        2767,
        30,
    ]  # "The quick brown fox jumps over the lazy dog."
    with ManagedServer(command, host="127.0.0.1", port=port, log_path=tmp_path / "vllm.log", env=vllm_env(1)) as server:
        server.wait_healthy(900)
        body = {"model": "smol", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(
            f"{server.base_url}/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.load(response)["choices"][0]
        pgid = server.pid
    assert pgid is not None and _group_gone(pgid)
    assert choice["token_ids"] == _greedy_reference(model_dir, prompt_ids, 8)


def _greedy_reference(model_dir: Path, prompt_ids: list[int], length: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=length, do_sample=False)
    return output[0, len(prompt_ids) :].tolist()
