"""The device check of issue 12: CUDA graphs, the CUDA memory paths and the engine's speed on one GPU,
in one command that prints one JSON summary.

    make gpu-check                                     # on the GPU host, gpu-wheels/ carried along
    python -m scripts.gpu_check --device cpu --quick   # the same code paths on a CPU, small

With `--out-dir` the summary (rewritten after each section, so that a check cut short keeps what it
measured) and the logs of the stack and of the tests land there too.

Each section is a module of this package (env.py, parity.py, throughput.py, serve.py, stack.py,
cuda_tests.py, roofline.py, and profile.py on request), check.py what they share, __main__.py the order,
the budget and the summary. Sections run in this order, each in its own `try`: a failure is recorded in
its entry (`error` and the end of the traceback) and the others still run; one that would start too
close to `--budget-s` is recorded as skipped. Within a section each system or phase is tried on its own
too.

- env: versions, the device and its memory.
- parity: tiny models (tests/tiny_models.py), fp32: greedy tokens with graphs on and off against
  transformers `generate` on the same device, with chunked prefill, prefix hits and a swap round trip
  in the mix (and the counts that show each happened); async batching on, or why it is refused. Each
  run says which forward and attention ran (on a GPU the Llama runs ours, gpu_llama.py, and once more
  with transformers' layers, the fallback: `CBSERVE_FORWARD=transformers`).
- throughput: a Llama-shaped model of about 1B parameters (random, seeded, bf16) on a decode-heavy
  workload (256 requests, 64 running): output tokens/s with graphs on and off and async on and off,
  the default again with transformers' layers in place of ours (what the fused forward adds), and
  transformers' own continuous batching with its CUDA graphs; decode steps/s at 64 running
  requests; step time by kind: whole decode graphs, piecewise graphs (prefill and mixed steps on
  our forward), eager steps, and the share left eager; capture time, graph count and memory of each.
- serve: the throughput load (prompts of one length) through `cbserve up --device cuda` on the same
  model, its defaults (graphs and async), by `cbserve bench serve` over gRPC: output tok/s, TTFT and
  inter-token latency, what the three processes keep of the in-process rate, and which forward and
  attention the worker ran (its start-up line).
- stack: `cbserve up --device cuda` on the tiny Llama: the worker maps the KV pool by CUDA IPC handle
  and registers the swap pool as pinned memory, a swap-out/in round trip, and a worker SIGKILL
  mid-stream whose streams finish identical to `generate`, after the restarted worker attached again.
- tests: the CUDA-only tests (`pytest -m cuda`).
- roofline: a Llama-3.1-8B-shaped model (random, bf16) on 1,024- and 4,096-token prompts: per decode
  step the share of the measured copy rate its reads reach, per prefill step that of the measured bf16
  matmul rate, output tok/s and TTFT, against transformers' continuous batching and the gather path
  (`roofline_section`). Last, and saved part by part: a stop inside it loses no other figure.

On a CPU (`--device cpu`) graphs cannot be captured: the graphs-on runs use `eager_capture`, the same
buckets and static inputs run eagerly, so that every path but the capture itself is exercised.
"""

import os

# As in tests/conftest.py: the stack's children start by a plain fork while gRPC channels are open.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
