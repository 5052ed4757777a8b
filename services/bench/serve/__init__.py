"""`cbserve bench serve`: a load generator driving a running server (one process, one asyncio loop; a
coroutine per request, no thread), over cbserve's gRPC API (`--backend cbserve`, the default: one
channel to a gateway) or OpenAI's HTTP API (`--backend openai`: any OpenAI-compatible server, smg in
front of cbserve or vLLM's own server; see openai_backend.py). Workloads, schedule and report are the
same for both (backends.py says what a backend does).

    cbserve bench serve --target 127.0.0.1:50051 --workload random --num-requests 64 \\
        --request-rate 4 --input-len 128 --output-len 64 --metrics-url http://127.0.0.1:9090/metrics
    cbserve bench serve --request-rates 1,2,4,8 --json sweep.json --plot sweep.png    # a sweep
    cbserve bench serve --concurrency 8 --duration 60                                 # closed loop
    cbserve bench serve --workload shared-prefix --num-groups 4 --prefix-len 512 --input-len 32
    cbserve bench serve --workload jsonl --dataset prompts.jsonl --no-ignore-eos
    cbserve bench serve --backend openai --target http://127.0.0.1:30080 --tokenizer MODEL_DIR \\
        --metrics-url http://127.0.0.1:9090/metrics                                   # over HTTP
    cbserve bench serve --backend openai --target http://127.0.0.1:30080 --tokenizer MODEL_DIR \\
        --baseline http://127.0.0.1:8000 --repeat 3          # two servers side by side (compare.py)

Load: open loop with Poisson arrivals at `--request-rate` (`inf`: all at once), or one phase per rate
of `--request-rates`; `--concurrency C` caps the requests in flight (closed loop with rate `inf`). A
phase ends after `--num-requests` or at `--duration` seconds: then no more requests are sent, and those
in flight are cancelled (the server frees their blocks) and counted as cancelled. Each phase starts
once the server is idle (when its load is known), with fresh prompts (a repeat would be served from
the prefix cache). For the same reason every run salts its requests' prefix cache with a new random
value (gRPC: `cache_salt`; HTTP: the words the prompts are written in): the same command run twice
against one stack sends the same requests, and the second run must not be served from the first
run's blocks (`--cache-salt ""` lets it).

Workloads: `random` (token-id prompts of random ids below the vocabulary size, GetModelInfo's or
`--tokenizer`'s model's; lengths uniform within ±`--range-ratio` of `--input-len` / `--output-len`;
EOS ignored so lengths are exact), `shared-prefix` (`--num-groups` long prefixes of `--prefix-len`,
each request one prefix plus a unique suffix of about `--input-len`; the prefix-cache hit rate comes
from the load's deltas and from the requests' cached prompt tokens (usage) against the shared tokens
after each group's first request),
`long-prompt` (short random requests plus ONE `--long-prompt-len` prompt, sent once the first
`--long-prompt-after` of them, a quarter by default, have their first token: a warm period, so that
its prefill meets decoding streams), and `jsonl` (`--dataset`, one object a line with `prompt` text
or `token_ids`, optional `max_tokens`).

long-prompt, with and without chunked prefill: the report gives the short requests' inter-token
latency while the long prompt is prefilled (from its send to its first token) and otherwise, median
and p99, and the ratio of the p99 during the prefill to the median otherwise (the issue's target: at
most 2 with chunking). Chunking is a server setting, so the contrast takes two stacks and two runs of
the same command (same seed, so the same requests):

    cbserve up --port 50777 --metrics-port 9777 --max-batch-tokens 32     # small steps: decodes + a chunk
    cbserve bench serve --target 127.0.0.1:50777 --workload long-prompt --request-rate 2 \\
        --num-requests 24 --input-len 64 --output-len 64 --long-prompt-len 4000
    cbserve up --port 50777 --metrics-port 9777 --max-batch-tokens 4096   # the long prompt in one step
    (the same bench command)

On a 2-core CPU a step's time follows its tokens, so the budget is the latency knob: 32 tokens (about
18 decodes plus a 14-token chunk) keep a chunked step within 2x a decode step. Adding
`--long-prefill-token-threshold` lets prompts that arrive behind the long one start sooner.

Reported per phase: request, output-token and total-token throughput; TTFT, ITL and E2E latency (mean,
p50, p90, p99); completed, failed (by status code) and cancelled counts; peak KV usage (the load sampled
every `--load-interval` s); prefix-cache hits, offloads and soft resets (load deltas); with
`--metrics-url`, the step profile (`cbserve:step_time_seconds` by phase, _sum/_count deltas of the
gateway's Prometheus endpoint around the phase). The load is GetLoad's over gRPC; over HTTP it is read
from `--metrics-url` (cbserve's or vLLM's metrics), and unknown without it. Definitions are in
`report`. Exit status 1 when a request failed or a completed one did not get exactly its
max_tokens (with EOS ignored).
"""
