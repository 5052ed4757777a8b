"""The peer-runner protocol: how `cbserve bench offline` drives an engine that is not ours.

A runner is a script run with its peer's own interpreter (its own virtualenv: the peers' pins clash
with ours and with each other), so this module uses the standard library only and the runners import
nothing of cbserve but it. The script's folder is on `sys.path` when it runs, which is how they find it.

    runner --model DIR --threads N [--precision default|fp32]
      loads its engine, warms it up (untimed), then writes to its protocol stream
    CBSERVE-PEER {"ready": true, "settings": {...}}
      and for each command line read from stdin,
    {"workload": FILE, "max_in_flight": C or null, "out": FILE}
      runs FILE's requests (JSON: {"prompts": [[ids]], "max_new_tokens": [n]}) greedy with EOS
      ignored, with at most C requests in flight (a closed loop: a request starts when another ends;
      null: all at once), writes {"outputs": [[ids]]} in workload order to `out`, and answers
    CBSERVE-PEER {"seconds": wall}
      timed from the first request in to the last token out. A second command, untimed,
    {"score": FILE, "out": FILE}
      scores FILE's prompts (JSON: {"prompts": [[ids]]}) teacher-forced: for each prompt, the token
      the engine ranks first after each of its positions but the last, having seen the true prompt up
      to there (never its own guesses), so the list of a prompt of n tokens has n - 1 ids, entry i
      the guess for token i + 1. It writes {"top1": [[ids]]} in prompt order to `out` and answers
    CBSERVE-PEER {"scored": positions}
      or, when the runner cannot score (it has no `score`, or scoring failed), it answers
    CBSERVE-PEER {"error": reason}
      and stays up: the harness reports that peer's agreement as n/a. At end of stdin it exits 0.

`--precision` says which arithmetic to run: `fp32` (what a runner does without the flag) pins the
engine's compute and KV cache to fp32, for a like-for-like comparison with an fp32 engine; `default`
leaves the engine's precision settings as they are for a user who installs it, which on a CPU with
bf16 instructions is usually bf16. The ready message's settings then say what the engine resolved
them to (`precision`, a short label for the table, and whatever detail the engine offers), not just
what was asked: a peer's default depends on the CPU and the model files.

The protocol stream is the process's original stdout; everything else (libraries print to stdout
freely) is sent to stderr, which the harness keeps in a log file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

PREFIX = "CBSERVE-PEER "
PRECISIONS = ("default", "fp32")

# Token ids below W1's 100..49052 range, so no prefix cache keeps anything a timed run could hit.
WARMUP_PROMPTS = [[1] + [42] * 63, [1] + [43] * 31]
WARMUP_NEW_TOKENS = 8


class Peer(Protocol):
    def run(self, prompts: list[list[int]], max_new_tokens: list[int], max_in_flight: int) -> list[list[int]]:
        """Greedy, EOS ignored; at most `max_in_flight` requests at once; outputs in prompt order."""
        ...

    def settings(self) -> dict[str, Any]: ...

    # Optional: `score(prompts) -> [[top-1 id per position 1..len-1]]`, teacher-forced (see above).
    # A runner without it answers every score command with an error.

    def close(self) -> None: ...


def closed_loop(
    count: int,
    max_in_flight: int,
    submit: Callable[[int], None],
    step: Callable[[], int],
) -> None:
    """Drive an engine that is stepped by hand: `submit(i)` starts request i, `step()` advances the
    engine and says how many requests it finished. Requests start in order, at most `max_in_flight`
    at a time."""
    started = in_flight = done = 0
    while done < count:
        while started < count and in_flight < max_in_flight:
            submit(started)
            started += 1
            in_flight += 1
        finished = step()
        in_flight -= finished
        done += finished


def serve(
    build: Callable[[argparse.Namespace], Peer], add_arguments: Callable[[Any], None] | None = None
) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the model: transformers' safetensors directory")
    parser.add_argument("--threads", type=int, required=True, help="cores the engine may use")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32: compute and KV cache pinned to fp32; default: the engine's own choice",
    )
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()

    protocol: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(message: dict[str, Any]) -> None:
        protocol.write(PREFIX + json.dumps(message) + "\n")

    peer = build(args)
    peer.run(WARMUP_PROMPTS, [WARMUP_NEW_TOKENS] * len(WARMUP_PROMPTS), len(WARMUP_PROMPTS))
    say({"ready": True, "settings": peer.settings()})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if "score" in command:
            say(_score(peer, command))
            continue
        with open(command["workload"]) as f:
            workload = json.load(f)
        prompts, limits = workload["prompts"], workload["max_new_tokens"]
        in_flight = command.get("max_in_flight") or len(prompts)
        start = time.perf_counter()
        outputs = peer.run(prompts, limits, in_flight)
        seconds = time.perf_counter() - start
        with open(command["out"], "w") as f:
            json.dump({"outputs": outputs}, f)
        say({"seconds": seconds})
    peer.close()
    return 0


def _score(peer: Peer, command: dict[str, Any]) -> dict[str, Any]:
    """One score command: the answer to send. A failure is answered, not raised: scoring is an extra
    beside the timed runs, and a peer that cannot do it must still serve them."""
    score = getattr(peer, "score", None)
    if score is None:
        return {"error": f"{type(peer).__name__} cannot score prompts (no teacher-forced logits)"}
    try:
        with open(command["score"]) as f:
            prompts = json.load(f)["prompts"]
        top1 = score(prompts)
        if [len(t) for t in top1] != [len(p) - 1 for p in prompts]:
            raise ValueError("scored a different number of positions than the prompts have")
        with open(command["out"], "w") as f:
            json.dump({"top1": [[int(t) for t in row] for row in top1]}, f)
    except Exception as exc:  # whatever the peer's scoring raises is reported, never fatal
        return {"error": f"scoring failed: {type(exc).__name__}: {exc}"}
    return {"scored": sum(len(t) for t in top1)}
