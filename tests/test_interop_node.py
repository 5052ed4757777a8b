"""Interop: a real Node.js client (@grpc/grpc-js + @grpc/proto-loader, the .proto loaded at run time,
no generated code) against the running stack. The client, tests/interop/node/client.mjs, prints one
JSON line per call and checks the stream's shape itself (exactly one `final`, last).

Request JSON uses proto3 JSON's lowerCamelCase field names (the client loads with keepCase: false).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).parent / "interop" / "node"
CLIENT = NODE_DIR / "client.mjs"
NPM_TIMEOUT_S = 300
CALL_TIMEOUT_S = 120  # generous: the first call may wait for the stack's warm-up
DEADLINE_MS = "60000"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None,
    reason="Node.js interop tests need `node` and `npm` on PATH",
)


def _deps_installed() -> bool:
    """Every dependency in package.json is in node_modules at its pinned version."""
    pinned = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]
    for name, version in pinned.items():
        manifest = NODE_DIR / "node_modules" / name / "package.json"
        if not manifest.is_file() or json.loads(manifest.read_text()).get("version") != version:
            return False
    return True


@pytest.fixture(scope="session")
def node_client() -> Callable[..., dict[str, Any]]:
    """Installs the npm deps once (npm ci, from package-lock.json); returns the client runner."""
    if not _deps_installed():
        npm = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=NPM_TIMEOUT_S,
            check=False,
        )
        if npm.returncode != 0:
            pytest.fail(f"npm ci failed ({npm.returncode}):\n{npm.stdout}\n{npm.stderr}")

    def run(target: str, *flags: str, **options: str) -> dict[str, Any]:
        """run(target, "health") or run(target, request=..., metadata="k=v"): --flag / --opt value."""
        args = ["--target", target, "--deadline-ms", DEADLINE_MS, *(f"--{flag}" for flag in flags)]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", value]
        proc = subprocess.run(
            ["node", str(CLIENT), *args], capture_output=True, text=True, timeout=CALL_TIMEOUT_S, check=False
        )
        # A non-zero exit is a usage error or a protocol violation the client detected;
        # gRPC errors come back as {"error": ...} with exit 0.
        if proc.returncode != 0:
            pytest.fail(f"node client exited {proc.returncode}: {proc.stderr.strip()}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


def _greedy_request(prompt_ids: list[int], max_tokens: int) -> str:
    return json.dumps(
        {
            "tokenIds": {"ids": prompt_ids},
            "sampling": {"temperature": 0},
            "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
        }
    )


def test_node_greedy_stream_matches_transformers(tiny_stack, node_client) -> None:
    prompt = [(37 * i + 11) % tiny_stack.vocab_size for i in range(6)]
    request_id = f"interop-node-{uuid.uuid4().hex[:12]}"
    out = node_client(
        tiny_stack.target, request=_greedy_request(prompt, 8), metadata=f"x-request-id={request_id}"
    )
    assert "error" not in out, out
    assert out["token_ids"] == tiny_stack.reference(prompt, 8)
    assert out["chunks"] >= 1
    final = out["final"]
    assert final["finishReason"] == "FINISH_REASON_LENGTH"
    assert final["usage"]["completionTokens"] == 8
    assert final["usage"]["promptTokens"] == len(prompt)
    # The request sets no request_id, so the server takes it from the call metadata.
    assert out["metadata"].get("x-request-id") == request_id
    assert final["requestId"] == request_id


@pytest.mark.parametrize("where", ["past_end", "negative"])
def test_node_out_of_vocab_id_is_invalid_argument(tiny_stack, node_client, where: str) -> None:
    bad_id = tiny_stack.vocab_size if where == "past_end" else -1
    out = node_client(tiny_stack.target, request=_greedy_request([1, bad_id], 4))
    assert out.get("error", {}).get("code") == 3, out  # grpc.status.INVALID_ARGUMENT
    assert out["error"]["name"] == "INVALID_ARGUMENT"


def test_node_health_check_serving(tiny_stack, node_client) -> None:
    assert node_client(tiny_stack.target, "health") == {"status": "SERVING"}


def test_node_model_info(tiny_stack, node_client) -> None:
    out = node_client(tiny_stack.target, "model-info")
    assert "error" not in out, out
    assert out["vocabSize"] == tiny_stack.vocab_size
