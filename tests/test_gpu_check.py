"""scripts/gpu_check on a CPU (`--device cpu --quick`): every section but the CUDA-only tests runs
the code paths it runs on a GPU, small, and the summary is one JSON document that holds the figures
the issue asks for. The capture itself (and so the figures of a device) needs a GPU: `make gpu-check`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.gpu_check import roofline
from scripts.gpu_check.check import Check

REPO = Path(__file__).resolve().parents[1]


# In the slow run (about 40 s on two cores: three stacks and every section); run it before a device call.
@pytest.mark.slow
def test_the_quick_cpu_check_runs_every_section_and_reports_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A generous budget: a busy machine must not turn figures into "out of time".
    argv = [
        sys.executable,
        "-m",
        "scripts.gpu_check",
        "--device",
        "cpu",
        "--quick",
        "--budget-s",
        "3600",
        "--sections",
        "env,parity,throughput,serve,stack",
        "--workdir",
        str(tmp_path),
        "--out-dir",
        str(out),
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout)
    assert summary == json.loads((out / "gpu_check.json").read_text())
    assert (out / "stack.log").stat().st_size > 0
    sections = summary["sections"]
    errors = {name: entry for name, entry in sections.items() if "error" in json.dumps(entry)}
    assert not errors, json.dumps(errors, indent=1)[:4000]

    llama = sections["parity"]["llama"]
    for run in ("graphs", "eager"):
        assert llama[run]["equal_generate"] is True, llama
        # Chunked prefill, prefix hits and a swap round trip all happened.
        assert llama[run]["prompt_chunks"] > 0 and llama[run]["prefix_hit_tokens"] > 0, llama
        assert llama[run]["swap_restores"] > 0, llama
    assert llama["graphs"]["graphs"]["replays"] > 0 and llama["eager"]["graphs"] is None
    assert llama["async"].get("equal_generate") is True or "refused" in llama["async"]
    # A GPU's fallback forward here (tests/cuda_forward.py); a GPU's parity runs report "triton".
    assert (llama["graphs"]["forward"], llama["graphs"]["attention"]) == ("transformers", "gather")

    throughput = sections["throughput"]
    systems = throughput["systems"]
    for name in ("graphs", "eager", "transformers_cb"):
        assert systems[name]["output_tok_s"] > 0, systems[name]
    assert systems["graphs"]["steps"]["steps"]["graph"] > 0
    if systems["graphs"]["forward"] == "native":  # our forward: prompt chunks replay its pieces
        assert systems["graphs"]["steps"]["steps"]["piecewise"] > 0, systems["graphs"]
    assert systems["graphs"]["decode_at_full_batch"]["steps_per_s"] > 0
    ratios = throughput["ratios"]
    assert ratios["same_tokens_graphs_eager"] == 1.0  # fp32: padding changes no token
    assert ratios["engine_over_transformers_cb"] is not None
    assert systems["graphs_async_transformers_layers"]["forward"] == "transformers"
    assert systems["graphs"]["forward"] in ("native", "transformers")  # the CPU's own, where built
    assert ratios["own_layers_over_transformers_layers"] is not None

    serve = sections["serve"]
    assert serve["requests"] == 12 and not serve["failed"] and serve["exit_code"] == 0, serve
    assert serve["paths"]["forward"] in ("native", "transformers"), serve  # a GPU's: "triton"
    assert serve["output_tok_s"] > 0 and serve["ttft_ms"]["p99"] >= serve["ttft_ms"]["p50"] > 0, serve
    assert summary["served_over_in_process"] > 0

    stack = sections["stack"]
    assert stack["attach"]["kv_handle"] == "shm" and stack["exit_code"] == 0
    assert stack["swap"]["streams_equal_generate"] is True and stack["swap"]["swap_restores"] > 0, stack
    kill = stack["worker_kill"]
    assert kill["streams_equal_generate"] is True and kill["restarted"] is True, kill
    assert kill["reattach"]["attaches"] == 2 and stack["idle_after"] is True
    assert summary["targets"]["greedy_identical"] is True
    assert summary["targets"]["stack_streams_identical"] is True


# ------------------------------------------------------------------------------------------- roofline


def quick_check(tmp_path: Path) -> Check:
    return Check("cpu", True, time.monotonic() + 3600, tmp_path)


def test_roofline_costs_of_the_tiny_llama_are_its_hand_counted_bytes_and_flops(tmp_path: Path) -> None:
    model = roofline.roofline_model(quick_check(tmp_path))
    costs = roofline.StepCosts.of(model)
    # LLAMA_TINY in float32: hidden 64, FFN 128, 2 layers, 4 heads / 2 KV heads of 16, vocab 512, untied.
    matrices = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)  # q, k and v, o, gate up and down
    norms = 2 * 2 * 64 + 64
    head = 512 * 64
    assert costs.weight_bytes == (2 * matrices + norms + head) * 4  # the input embedding read by rows
    assert costs.row_bytes == 64 * 4
    assert costs.kv_token_bytes == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16
    assert costs.layer_flops_per_token == 2 * 2 * matrices
    assert costs.head_flops_per_row == 2 * head
    assert costs.attention_flops_per_pair == 4 * 4 * 16 * 2

    decode = roofline.StepRecord([(40, 1, False), (10, 1, False)], logit_rows=2)
    assert (
        costs.read_bytes(decode)
        == costs.weight_bytes + 2 * costs.row_bytes + (41 + 11) * costs.kv_token_bytes
    )
    # A chunk of 8 prompt tokens from position 4: positions 4..11 attend 5..12 keys.
    chunk = roofline.StepRecord([(4, 8, True)], logit_rows=1)
    pairs = sum(range(5, 13))
    assert chunk.attended_pairs == pairs
    assert costs.flops(chunk) == 8 * 2 * 2 * matrices + 2 * head + pairs * 4 * 4 * 16 * 2


def test_roofline_steady_state_is_every_running_request_decoding() -> None:
    record = roofline.StepRecord
    costs = roofline.StepCosts(1000, 10, 100, 1, 1, 1)
    rates = {"copy_bytes_per_s": 1e6, "matmul_flops_per_s": 1e3}
    steps = [
        record([(0, 16, True)], 1, seconds=0.5),  # a full prefill step: qualifies
        record([(16, 1, False), (0, 15, True)], 2, seconds=0.5),  # full, mixed: qualifies
        record([(17, 1, False), (15, 1, True)], 2),  # a prompt's last token beside a decode: neither
        record([(18, 1, False), (16, 1, False)], 2, seconds=0.002),  # 2 of 3 running: ramp-up
        record([(19, 1, False), (17, 1, False), (20, 1, False)], 3, seconds=0.002),  # steady
        record([(20, 1, False), (18, 1, False), (21, 1, False)], 3, seconds=0.004),  # steady
        record([(21, 1, False), (19, 1, False)], 2, seconds=0.001),  # the tail
    ]
    figures = roofline.step_figures(steps, costs, rates, running=3, prefill_tokens=16)
    steady_bytes = [1000 + 3 * 10 + (20 + 18 + 21) * 100, 1000 + 3 * 10 + (21 + 19 + 22) * 100]
    assert figures["decode"]["steady_steps"] == 2
    fractions = [steady_bytes[0] / 1e6 / 0.002, steady_bytes[1] / 1e6 / 0.004]
    assert figures["decode"]["fraction_median"] == pytest.approx(sum(fractions) / 2, abs=1e-3)
    assert figures["decode"]["step_ms_median"] == pytest.approx(3.0)
    assert figures["prefill"]["steps"] == 2 and figures["prefill"]["tokens"] == [16, 16]
    flops = [16 + 1 + 136, 16 + 2 + (17 + sum(range(1, 16)))]
    assert figures["prefill"]["fraction_median"] == pytest.approx(sum(flops) / 2 / 0.5 / 1e3, abs=1e-3)
    assert figures["mixed_or_partial_steps"] == 3


def test_roofline_scale_shrinks_the_requests_and_the_running_with_them() -> None:
    a, b = roofline.ROOFLINE_LOADS
    assert (a.requests, a.running, b.requests, b.running) == (128, 128, 32, 32)  # one wave each
    assert (a.scaled(0.5).requests, a.scaled(0.5).running) == (64, 64)
    assert (a.scaled(2).requests, a.scaled(2).running) == (256, 128)
    assert b.scaled(0.01).requests == 1


def test_the_quick_cpu_roofline_section_reports_each_system(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "scripts.gpu_check",
        "--device",
        "cpu",
        "--quick",
        "--budget-s",
        "3600",
        "--sections",
        "roofline",
        "--workdir",
        str(tmp_path),
        "--out-dir",
        str(out),
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout)
    assert summary == json.loads((out / "gpu_check.json").read_text())
    roofline = summary["sections"]["roofline"]
    assert "error" not in json.dumps(roofline) and "partial" not in roofline, json.dumps(roofline)[:4000]
    assert roofline["rates"]["copy_bytes_per_s"] > 0 and roofline["rates"]["matmul_flops_per_s"] > 0
    for name, load in roofline["loads"].items():
        workload = load["workload"]
        systems = load["systems"]
        assert (
            systems["engine"]["attention"] == "native" and systems["engine_gather"]["attention"] == "gather"
        )
        for system in systems.values():
            assert system["output_tok_s"] > 0 and system["ttft_ms_median"] > 0, (name, system)
        for engine in (systems["engine"], systems["engine_gather"]):
            decode, prefill = engine["decode"], engine["prefill"]
            # The first token comes from a request's prefill: at most new_tokens - 1 decode steps each.
            assert 0 < decode["steady_steps"] <= workload["new_tokens"] - 1, engine
            assert decode["fraction_median"] > 0 and decode["step_ms_median"] > 0
            assert prefill["steps"] > 0 and min(prefill["tokens"]) >= engine["settings"]["max_batch_tokens"]
            assert prefill["fraction_median"] > 0
        assert load["engine_over_transformers_cb"] > 0 and load["engine_over_gather"] > 0
    targets = summary["targets"]
    for key in ("roofline_decode_0.70_a", "roofline_decode_0.70_b", "roofline_prefill_0.55"):
        assert isinstance(targets[key], bool), targets
    assert isinstance(targets["roofline_engine_5x_transformers_cb_a"], bool)
