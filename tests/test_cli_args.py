"""Settings on the command line and in CBSERVE_* variables: a bad one ends the command with exit
status 2 and one line naming it, not a traceback, and before any process or model is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import build_parser, main
from services.common.cli_args import cb_config
from services.common.config import CBConfig


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `cbserve argv`, which must end with exit status 2; returns what it wrote on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--page-size", "0"], "page_size must be a positive int, got 0"),
        (["up", "--safety-margin", "1.5"], "safety_margin must be in [0, 1), got 1.5"),
        (["worker", "--use-cuda-graph"], "use_cuda_graph needs a CUDA device, this one is 'cpu'"),
        (["up", "--device", "cpu", "--use-cuda-graph"], "use_cuda_graph needs a CUDA device"),
    ],
)
def test_a_bad_setting_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(argv, capsys)
    assert err.startswith(f"cbserve: error: {message}") and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--port", "99999"], "argument --port: must be in [0, 65535], got '99999'"),
        (["gateway", "--max-queue-size", "-5"], "argument --max-queue-size: must be >= 1, got '-5'"),
        (["worker", "--gateway-timeout", "0"], "argument --gateway-timeout: must be > 0, got '0'"),
        (["up", "--drain-grace", "nan"], "argument --drain-grace: must be >= 0, got 'nan'"),
        (["up", "--threads", "two"], "argument --threads: not an int: 'two'"),
        (["bench", "offline", "--num-requests", "0"], "argument --num-requests: must be >= 1, got '0'"),
        (["bench", "offline", "--repeat", "0"], "argument --repeat: must be >= 1, got '0'"),
    ],
)
def test_a_flag_out_of_range_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prog = " ".join(["cbserve", *argv[: 2 if argv[0] == "bench" else 1]])
    assert usage_error(argv, capsys).splitlines()[-1] == f"{prog}: error: {message}"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("CBSERVE_PAGE_SIZE", "abc", "CBSERVE_PAGE_SIZE='abc': invalid literal for int()"),
        (
            "CBSERVE_ALLOW_BLOCK_SHARING",
            "maybe",
            "CBSERVE_ALLOW_BLOCK_SHARING='maybe': not a boolean: 'maybe'",
        ),
        ("CBSERVE_METRICS_PORT", "70000", "CBSERVE_METRICS_PORT='70000': must be in [0, 65535], got '70000'"),
    ],
)
def test_a_bad_variable_is_a_usage_error(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, value)
    assert usage_error(["up"], capsys).startswith(f"cbserve: error: {message}")


def test_variables_set_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_PAGE_SIZE", "16")
    monkeypatch.setenv("CBSERVE_ALLOW_BLOCK_SHARING", "off")
    config = cb_config(build_parser().parse_args(["worker", "--max-batch-tokens", "64"]))
    assert (config.page_size, config.allow_block_sharing, config.max_batch_tokens) == (16, False, 64)
    assert cb_config(build_parser().parse_args(["worker", "--page-size", "8"])).page_size == 8


def test_the_device_switches_may_be_named_off_and_async_batching_on() -> None:
    config = cb_config(
        build_parser().parse_args(["worker", "--no-use-cuda-graph", "--no-use-async-batching"])
    )
    assert config.use_cuda_graph is False and config.use_async_batching is False
    assert cb_config(build_parser().parse_args(["worker", "--use-async-batching"])).use_async_batching
    # Unset: on where graphs leave the host idle (a GPU), off where host and forward share the cores
    # or, eager, the GIL.
    assert CBConfig().use_async_batching is None
    assert CBConfig().async_batching_enabled("cuda") and not CBConfig().async_batching_enabled("cpu")
    assert not CBConfig(use_cuda_graph=False).async_batching_enabled("cuda")
    assert not CBConfig(use_async_batching=False).async_batching_enabled("cuda")
    assert CBConfig(use_async_batching=True).async_batching_enabled("cpu")


def test_cuda_graphs_follow_the_device() -> None:
    # Unset: on where graphs can run, off elsewhere; asked for on a CPU: refused, never ignored.
    assert CBConfig().cuda_graph_enabled("cuda") and not CBConfig().cuda_graph_enabled("cpu")
    assert not CBConfig(use_cuda_graph=False).cuda_graph_enabled("cuda")
    assert CBConfig(use_cuda_graph=True).cuda_graph_enabled("cuda")
    with pytest.raises(ValueError, match="use_cuda_graph needs a CUDA device, this one is 'cpu'"):
        CBConfig(use_cuda_graph=True).cuda_graph_enabled("cpu")
    # Checked against the command's device without touching one: a CPU host may configure a GPU stack.
    config = cb_config(build_parser().parse_args(["worker", "--device", "cuda:1", "--use-cuda-graph"]))
    assert config.use_cuda_graph is True


@pytest.mark.parametrize(
    "command", [["up"], ["cachemgr"], ["worker"], ["gateway"], ["bench", "offline"], ["chat"]]
)
def test_a_bad_model_is_a_usage_error_before_anything_starts(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `up` used to start its three children on it, and restart each as it died, for ever.
    for model, message in [
        ("/nonexistent", "unknown model '/nonexistent': expected 'smollm2' or an existing local model"),
        (str(tmp_path), f"model directory {str(tmp_path)!r} has no config.json"),
    ]:
        assert usage_error([*command, "--model", model], capsys).startswith(f"cbserve: error: {message}")
