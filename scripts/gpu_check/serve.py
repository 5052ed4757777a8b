"""serve: the throughput load through `cbserve up`, driven over gRPC by `cbserve bench serve`."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from scripts.gpu_check.check import REPO, Check, Entry, attempt, release_memory
from scripts.gpu_check.stack import attach_facts
from scripts.gpu_check.throughput import speed_model, speed_settings


def serve_section(check: Check) -> Entry:
    """The throughput section's load through the three processes, on the device's defaults (graphs
    and async batching on a GPU), driven over gRPC by `cbserve bench serve`: 256 requests of 80 prompt
    tokens and 256 new tokens each, 64 in flight (`--quick`: 12 of 16 and 8, 4 in flight). Output
    tok/s, time to first token and inter-token latency, what the stack keeps of the in-process rate."""
    from services.supervisor import cbserve_argv
    from tests.stack import Stack

    model_dir = check.workdir / "speed-model"
    if not (model_dir / "config.json").is_file():
        model = speed_model(check)
        model.save_pretrained(model_dir)
        del model
        release_memory()
    count, prompt, new_tokens, running = (12, 16, 8, 4) if check.quick else (256, 80, 256, 64)
    dtype = "bfloat16" if check.device == "cuda" else "float32"
    logs = check.workdir / "serve"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    stack = Stack(
        model_dir,
        logs,
        up_args=["--device", check.device, "--dtype", dtype],
        start_timeout_s=check.stack_start_s(),
        **speed_settings(check),
    )
    entry: Entry = {"start_s": round(time.monotonic() - started, 1), "log": str(stack.log_path)}
    report = logs / "serve.json"
    try:
        argv = cbserve_argv(
            "bench",
            "serve",
            "--target",
            stack.target,
            "--workload",
            "random",
            "--ignore-eos",
            "--num-requests",
            str(count),
            "--concurrency",
            str(running),
            "--input-len",
            str(prompt),
            "--output-len",
            str(new_tokens),
            "--json",
            str(report),
            "--no-progress",
        )
        timeout = max(30.0, check.seconds_left(keep=90))
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"cbserve bench serve exited {done.returncode}: {done.stderr[-600:]}")
        phase = json.loads(report.read_text())["phases"][0]
        latency = phase["latency_s"]
        entry |= {
            "requests": phase["requests"]["completed"],
            "failed": phase["requests"]["failed"],
            "output_tok_s": round(phase["throughput"]["output_tokens_per_s"], 1),
            "ttft_ms": {k: round(latency["ttft"][k] * 1e3, 1) for k in ("p50", "p99")},
            "itl_ms": {k: round(latency["itl"][k] * 1e3, 2) for k in ("p50", "p99")},
            "worker": attach_facts(stack),
        }
    finally:
        entry["exit_code"] = stack.stop()
    attempt(entry, "paths", worker_paths, stack.log_path)
    return entry


def worker_paths(log_path: Path) -> Entry | None:
    """Which forward and attention kernels a stack's worker ran, from its JSON start-up line."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"worker ready"' in line:
            fields = json.loads(line)
            return {key: fields.get(key) for key in ("forward", "attention")}
    return None
