"""Runs the Node.js interop clients for tests in any module, each returning the one JSON line the
client prints:
- `node_client(target, ...)`: tests/interop/node/client.mjs, @grpc/grpc-js with the .proto loaded at
  run time, no generated code. Its npm dependencies are installed once (npm ci, from
  package-lock.json) when node_modules lacks them.
- `node_openai_stream(base_url, endpoint, body)`: tests/interop/node/openai_stream.mjs, an OpenAI-style
  HTTP client with plain `fetch` and its own SSE reader; it needs nothing from npm."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).parent / "node"
CLIENT = NODE_DIR / "client.mjs"
OPENAI_STREAM = NODE_DIR / "openai_stream.mjs"
NPM_TIMEOUT_S = 300
CALL_TIMEOUT_S = 120  # generous: the first call may wait for the stack's warm-up
DEADLINE_MS = "60000"

needs_node = pytest.mark.skipif(
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
    """Installs the npm deps if needed; returns the client runner."""
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
        """run(target, "health") or run(target, request=..., metadata="k=v", tls_ca=PATH): --flag /
        --opt value."""
        args = ["--target", target, "--deadline-ms", DEADLINE_MS, *(f"--{flag}" for flag in flags)]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", value]
        return _run_node(CLIENT, args)

    return run


def node_openai_stream(base_url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion through openai_stream.mjs: `endpoint` is chat or completion."""
    request = ["--endpoint", endpoint, "--body", json.dumps(body)]
    return _run_node(OPENAI_STREAM, ["--base-url", base_url, *request, "--timeout-ms", DEADLINE_MS])


def _run_node(script: Path, args: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        ["node", str(script), *args], capture_output=True, text=True, timeout=CALL_TIMEOUT_S, check=False
    )
    # A non-zero exit is a usage error or a protocol violation the client detected; errors of the
    # call itself (a gRPC status, an HTTP status) come back as {"error": ...} with exit 0.
    if proc.returncode != 0:
        pytest.fail(f"{script.name} exited {proc.returncode}: {proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def greedy_request(prompt_ids: list[int], max_tokens: int) -> str:
    """A GenerateRequest in proto3 JSON (lowerCamelCase names, as the client loads them)."""
    return json.dumps(
        {
            "tokenIds": {"ids": prompt_ids},
            "sampling": {"temperature": 0},
            "stopping": {"maxTokens": max_tokens, "ignoreEos": True},
        }
    )
