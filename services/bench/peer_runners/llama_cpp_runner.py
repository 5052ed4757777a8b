"""Peer runner: llama.cpp's `llama-server` with an F32 GGUF, one HTTP client per request in flight.

The harness builds the server and converts the model (`--model` is the F32 GGUF, `--server` the
binary). 48 slots with an f32 KV cache (its default is f16) and the whole machine's cores; prompts go
in as token ids, greedy, with the prompt cache off. llama.cpp's `ignore_eos` masks EOS rather than
passing it over, so a request whose greedy choice is EOS continues differently than in the others.

Precision: llama.cpp computes with the GGUF's own weight types, so what it runs is chosen by the
conversion, not by a runtime setting; `--precision` changes nothing here and the harness runs this
peer once whatever `--peer-precision` says. `settings()` labels what ran: the GGUF's type (from the
harness's file name, `...-f32.gguf`) and the KV cache's.

There is no `score` (the protocol's teacher-forced command): this runner asks llama-server only for
generated tokens, never for the logits at the prompt's positions, so `--agreement` reports it n/a.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

# At run time this script's folder is on sys.path (protocol.py); the type checker knows the same file
# as a module of the services package.
if TYPE_CHECKING:
    from services.bench.peer_runners.protocol import serve
else:
    from protocol import serve

SLOTS = 48
SLOT_CONTEXT = 1024
KV_TYPE = "f32"


class LlamaCppPeer:
    def __init__(self, args: argparse.Namespace) -> None:
        port = args.port
        self.weights = Path(args.model).stem.rpartition("-")[2]  # f32, f16, q8_0...
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [
            args.server,
            "-m",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(SLOTS * SLOT_CONTEXT),
            "-np",
            str(SLOTS),
            "-t",
            str(args.threads),
            "-b",
            "512",
            "-ub",
            "512",
            "-ctk",
            KV_TYPE,
            "-ctv",
            KV_TYPE,
            "-cram",
            "0",
            "--no-webui",
        ]
        self.server = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(self.argv)}")
            time.sleep(0.5)

    def _complete(self, prompt: list[int], n: int) -> list[int]:
        body = {
            "prompt": prompt,
            "n_predict": n,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            self.url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=3600) as r:
            return [int(t) for t in json.load(r)["tokens"]]

    def run(self, prompts: list[list[int]], max_new_tokens: list[int], max_in_flight: int) -> list[list[int]]:
        with ThreadPoolExecutor(max_workers=min(max_in_flight, SLOTS)) as pool:
            return list(pool.map(self._complete, prompts, max_new_tokens))

    def settings(self) -> dict[str, Any]:
        return {"precision": f"{self.weights} GGUF, KV {KV_TYPE}", "argv": self.argv[1:]}

    def close(self) -> None:
        self.server.terminate()
        self.server.wait(30)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="the llama-server binary")
    parser.add_argument("--port", type=int, required=True, help="a free port on 127.0.0.1 for it")


if __name__ == "__main__":
    raise SystemExit(serve(LlamaCppPeer, _arguments))
