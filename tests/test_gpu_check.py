"""scripts/gpu_check.py on a CPU (`--device cpu --quick`): every section but the CUDA-only tests runs
the code paths it runs on a GPU, small, and the summary is one JSON document that holds the figures
the issue asks for. The capture itself (and so the figures of a device) needs a GPU: `make gpu-check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def test_the_quick_cpu_check_runs_every_section_and_reports_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A generous budget: a busy machine must not turn figures into "out of time".
    argv = [
        sys.executable,
        "scripts/gpu_check.py",
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

    throughput = sections["throughput"]
    systems = throughput["systems"]
    for name in ("graphs", "eager", "transformers_cb"):
        assert systems[name]["output_tok_s"] > 0, systems[name]
    assert systems["graphs"]["steps"]["steps"]["graph"] > 0
    assert systems["graphs"]["decode_at_full_batch"]["steps_per_s"] > 0
    ratios = throughput["ratios"]
    assert ratios["same_tokens_graphs_eager"] == 1.0  # fp32: padding changes no token
    assert ratios["engine_over_transformers_cb"] is not None

    serve = sections["serve"]
    assert serve["requests"] == 12 and not serve["failed"] and serve["exit_code"] == 0, serve
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
