"""Soak: many requests mixing normal streams, cancellations at random points, short deadlines, stop
strings and bad requests, against the real SmolLM2 stack. Afterwards nothing is held anywhere (blocks,
swap slots, the worker's and the cachemgr's request state, the gateway's streams), the processes'
memory did not grow, and every completed greedy stream equals its reference.

`make test` runs a short version; `make soak` runs CBSERVE_SOAK_REQUESTS=3000.
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
from transformers import AutoTokenizer

from services.gateway.api import pb
from tests.stack import Stack, hf_greedy, rss_kib

REQUESTS = int(os.environ.get("CBSERVE_SOAK_REQUESTS", "120"))
CONCURRENCY = 16
NEW_TOKENS = 6
# Cancelled and expired requests ask for far more than they can generate before their end, so each is
# aborted mid-stream: the "nothing held" checks below are about them.
ABORTED_TOKENS = 400
QUESTIONS = ["Name a color.", "What is 2+2?", "Say hi.", "Name a fruit.", "What is the sun?", "Count to 3."]
STOPS = [" the", ".", ","]
OUTCOMES = {
    "normal": "OK",
    "stop": "OK",
    "bad": "INVALID_ARGUMENT",
    "deadline": "DEADLINE_EXCEEDED",
    "cancel": "CANCELLED",
}


def metrics(stack: Stack) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and line[0] != "#")}


def test_soak(smol_stack: Stack) -> None:
    stack = smol_stack
    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    prompts, references = [], []
    for question in QUESTIONS:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        prompts.append(ids)
        references.append(hf_greedy(stack.model_dir, ids, NEW_TOKENS, eos=True))
    rng = random.Random(1234)
    kinds = ["normal", "normal", "cancel", "deadline", "stop", "bad"]
    plans = [(rng.choice(kinds), rng.randrange(len(prompts)), rng.random()) for _ in range(REQUESTS)]
    outcomes: Counter[tuple[str, str]] = Counter()
    lock = threading.Lock()

    def run(plan: tuple[str, int, float]) -> None:
        kind, p, x = plan
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[p]))
        request.sampling.temperature = 0.0
        aborted = kind in ("cancel", "deadline")
        request.stopping.max_tokens = ABORTED_TOKENS if aborted else NEW_TOKENS
        request.stopping.ignore_eos = aborted
        if kind == "bad":
            request.token_ids.ids.append(10**6 if x < 0.5 else -1)
        if kind == "stop":
            request.stopping.stop.extend(STOPS)
        timeout = 0.05 + x * 0.3 if kind == "deadline" else 120.0
        call = stack.stub.Generate(request, timeout=timeout)
        ids, text, final = [], [], None
        try:
            for i, response in enumerate(call):
                if kind == "cancel" and i >= int(x * 4):
                    call.cancel()
                    break
                if response.HasField("chunk"):
                    ids += response.chunk.token_ids
                    text.append(response.chunk.text)
                else:
                    final = response.final
        except grpc.RpcError as exc:
            assert exc.code().name == OUTCOMES[kind], (kind, exc.code(), exc.details())
            with lock:
                outcomes[kind, exc.code().name] += 1
            return
        if final is None:
            assert kind == "cancel", kind
            with lock:
                outcomes[kind, "CANCELLED"] += 1
            return
        assert OUTCOMES[kind] == "OK", (kind, final)
        if kind == "normal":
            assert ids == references[p], (ids, references[p])
        else:
            whole = tokenizer.decode(references[p], skip_special_tokens=True)
            cut = min((whole.find(s) for s in STOPS if s in whole), default=len(whole))
            assert "".join(text) == whole[:cut]
        with lock:
            outcomes[kind, "OK"] += 1

    children = {name: stack.child_pid(name) for name in ("cachemgr", "worker", "gateway")}
    warm = max(REQUESTS // 4, 16)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(run, plans[:warm]))
        baseline = {name: rss_kib(pid) for name, pid in children.items()}
        start = time.monotonic()
        list(pool.map(run, plans[warm:]))
    elapsed = time.monotonic() - start

    stack.assert_idle()
    deadline = time.monotonic() + 10
    while True:  # the load gauges follow the worker's periodic status
        m = metrics(stack)
        held = {
            k: m[k] for k in ("cbserve:gateway_streams", "cbserve:worker_streams", "cbserve:cache_requests")
        }
        if not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(held.values()), held
    assert {name: stack.child_pid(name) for name in children} == children, "a process restarted"
    growth = {name: rss_kib(pid) / baseline[name] - 1 for name, pid in children.items()}
    print(
        f"\nsoak: {REQUESTS} requests in {elapsed:.1f} s after warm-up; outcomes {dict(outcomes)}; "
        f"RSS growth { ({k: f'{v:+.1%}' for k, v in growth.items()}) }"
    )
    assert all(g < 0.10 for g in growth.values()), growth
    assert outcomes == Counter((kind, OUTCOMES[kind]) for kind, _, _ in plans), outcomes
    assert {kind for kind, _ in outcomes} == set(OUTCOMES), outcomes
