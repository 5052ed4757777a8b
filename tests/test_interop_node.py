"""Interop: a real Node.js client (@grpc/grpc-js + @grpc/proto-loader, the .proto loaded at run time,
no generated code) against the running stack, its answers checked against transformers' or the Python
API's. The client, tests/interop/node/client.mjs, prints one JSON line per call and checks the
stream's shape itself (exactly one `final`, last).

Request JSON uses proto3 JSON's lowerCamelCase field names (the client loads with keepCase: false).
"""

from __future__ import annotations

import json
import uuid

import pytest
from transformers import AutoTokenizer

from services.gateway.api import pb
from tests.interop.node_runner import greedy_request, needs_node, node_client
from tests.stack import greedy_request as pb_greedy_request

pytestmark = needs_node
__all__ = ["node_client"]  # a fixture, used by name: exported so that its import counts as used


def test_node_greedy_stream_matches_transformers(tiny_stack, node_client) -> None:
    prompt = [(37 * i + 11) % tiny_stack.vocab_size for i in range(6)]
    request_id = f"interop-node-{uuid.uuid4().hex[:12]}"
    out = node_client(
        tiny_stack.target, request=greedy_request(prompt, 8), metadata=f"x-request-id={request_id}"
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
    out = node_client(tiny_stack.target, request=greedy_request([1, bad_id], 4))
    assert out.get("error", {}).get("code") == 3, out  # grpc.status.INVALID_ARGUMENT
    assert out["error"]["name"] == "INVALID_ARGUMENT"


def test_node_health_check_serving(tiny_stack, node_client) -> None:
    assert node_client(tiny_stack.target, "health") == {"status": "SERVING"}


def test_node_model_info(tiny_stack, node_client) -> None:
    out = node_client(tiny_stack.target, "model-info")
    assert "error" not in out, out
    assert out["vocabSize"] == tiny_stack.vocab_size


def test_node_detokenize_matches_the_python_api(smol_stack, node_client) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smol_stack.model_dir, local_files_only=True)
    ids = tokenizer("Detokenized in Node: héllo wörld 🌍", add_special_tokens=False)["input_ids"]
    ids += list(smol_stack.info.eos_token_ids)
    for skip in (False, True):
        request = {"tokenIds": ids, "skipSpecialTokens": skip}
        out = node_client(smol_stack.target, detokenize=json.dumps(request))
        python = smol_stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip))
        assert out == {"text": python.text}
    bad = node_client(smol_stack.target, detokenize=json.dumps({"tokenIds": [5, smol_stack.vocab_size]}))
    assert bad["error"]["name"] == "INVALID_ARGUMENT" and "out of vocabulary" in bad["error"]["details"]


def test_node_prompt_logprobs_match_the_python_api(tiny_stack, node_client) -> None:
    prompt = [(29 * i + 5) % tiny_stack.vocab_size for i in range(12)]
    request = json.loads(greedy_request(prompt, 2)) | {"output": {"promptLogprobs": 2}}
    out = node_client(tiny_stack.target, request=json.dumps(request))
    python = pb_greedy_request(prompt, 2)
    python.output.prompt_logprobs = 2
    expected = [lp for r in tiny_stack.stub.Generate(python, timeout=60) for lp in r.chunk.prompt_logprobs]
    assert len(expected) == len(prompt) - 1
    got = out["prompt_logprobs"]
    assert [lp["tokenId"] for lp in got] == [lp.token_id for lp in expected] == prompt[1:]
    for node, py in zip(got, expected, strict=True):
        assert node["logprob"] == pytest.approx(py.logprob, abs=1e-5)
        assert [t["tokenId"] for t in node["top"]] == [t.token_id for t in py.top]
