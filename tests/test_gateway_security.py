"""The public port (TLS, mutual TLS, API keys) and tenants kept apart (cache_salt, streams per key).

One `cbserve up` stack on the tiny Llama serves TLS with API keys (one from `--api-key`, one from a
key file), a per-key stream limit and a plaintext health port, all set on `cbserve up` and passed
through to its gateway. A second `cbserve gateway` on the same worker asks for client
certificates too and keeps health and reflection closed. Certificates are made at test time
(tests/certs.py); clients are Python's grpcio, the `cbserve` command line and the Node.js client.
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.cli import build_parser, main
from services.common.wire import INTERNAL_KEY_ENV
from services.gateway.api import SERVICE_NAME, pb, pb_grpc
from services.gateway.command import public_port
from services.gateway.security import ApiKeys, split_keys
from services.supervisor import cbserve_argv, die_with_parent, free_port, stop_process
from tests.certs import Pki, make_pki
from tests.interop.node_runner import greedy_request as node_request
from tests.interop.node_runner import needs_node, node_client
from tests.stack import REPO, START_TIMEOUT_S, Metadata, Stack, greedy_request

__all__ = ["node_client"]  # a fixture, used by name: exported so that its import counts as used

# Fresh per run, so that finding one in a log means it was logged.
# Prefixed: a urlsafe token may start with "-", which argparse reads as a flag after `--api-key`.
ALPHA, BETA, WRONG = ("k" + secrets.token_urlsafe(24) for _ in range(3))
MAX_STREAMS = 2
PAGE_SIZE = 8
OK, UNAUTHENTICATED, UNAVAILABLE = (
    grpc.StatusCode.OK,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNAVAILABLE,
)
HEALTH_CHECK = health_pb2.HealthCheckRequest()


def bearer(key: str) -> Metadata:
    return (("authorization", f"Bearer {key}"),)


def code_of(call: Callable[..., Any], *args: Any) -> grpc.StatusCode:
    """The status `call(*args)` ends with."""
    try:
        call(*args)
    except grpc.RpcError as exc:
        return exc.code()
    return OK


def streamed_ids(responses: Iterator[Any]) -> list[int]:
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def prompt(seed: int, length: int = 8) -> list[int]:
    """Token ids no other test sends (ids 0-2 are BOS/EOS/PAD), so prefix-cache figures are its own."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def tls(pki: Pki, client: bool = False) -> grpc.ChannelCredentials:
    if not client:
        return grpc.ssl_channel_credentials(pki.ca.read_bytes())
    return grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), pki.client.key.read_bytes(), pki.client.cert.read_bytes()
    )


class Gateway:
    """Another `cbserve gateway` on a stack's worker (gateways may share one), with flags of its own."""

    def __init__(
        self, stack: Stack, log_dir: Path, flags: list[str], credentials: grpc.ChannelCredentials, key: str
    ) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"gateway-{self.port}.log"
        self.metadata = bearer(key)
        argv = cbserve_argv(
            "gateway",
            "--model",
            str(stack.model_dir),
            "--port",
            str(self.port),
            "--worker-address",
            f"ipc://{stack.runtime_dir() / 'worker.sock'}",
            "--metrics-port",
            "0",
            *flags,
        )
        env = os.environ | {INTERNAL_KEY_ENV: stack.internal_key}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=log, stderr=log, preexec_fn=die_with_parent
            )
        self.channel = grpc.secure_channel(self.target, credentials)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while self.health_status(self.metadata) != "SERVING":
                assert self.process.poll() is None, self.log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, self.log_path.read_text()[-3000:]
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise

    def health_status(self, metadata: Metadata = ()) -> str:
        try:
            reply = self.health.Check(HEALTH_CHECK, timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def stop(self) -> None:
        self.channel.close()
        stop_process(self.process, 30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def health_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def secure_stack(
    tiny_models: Callable[[str], Path], pki: Pki, health_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("secure_stack")
    key_file = folder / "api-keys"
    key_file.write_text(f"# tenant beta\n\n{BETA}\n")
    up_args = [
        "--tls-cert",
        str(pki.server.cert),
        "--tls-key",
        str(pki.server.key),
        "--api-key",
        ALPHA,
        "--api-key-file",
        str(key_file),
        "--max-streams-per-key",
        str(MAX_STREAMS),
        "--health-port",
        str(health_port),
    ]
    stack = Stack(
        tiny_models("llama"),
        folder,
        up_args=up_args,
        credentials=tls(pki),
        metadata=bearer(ALPHA),
        page_size=PAGE_SIZE,
        num_blocks=256,
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def mtls_gateway(secure_stack: Stack, pki: Pki) -> Iterator[Gateway]:
    flags = [
        "--tls-cert",
        str(pki.server.cert),
        "--tls-key",
        str(pki.server.key),
        "--tls-client-ca",
        str(pki.ca),
        "--api-key",
        ALPHA,
        "--no-open-health",
        "--no-open-reflection",
    ]
    gateway = Gateway(secure_stack, secure_stack.log_path.parent, flags, tls(pki, client=True), ALPHA)
    yield gateway
    gateway.stop()


# ----------------------------------------------------------------------------- settings, no stack


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gateway", "--tls-cert", "{server.cert}"], "--tls-cert and --tls-key go together"),
        (["up", "--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["gateway", "--tls-cert", "{server.cert}", "--tls-key", "{client.key}"], "KEY_VALUES_MISMATCH"),
        (
            [
                "up",
                "--tls-cert",
                "{server.cert}",
                "--tls-key",
                "{server.key}",
                "--tls-client-ca",
                "{server.key}",
            ],
            "--tls-client-ca",
        ),
        (["gateway", "--max-streams-per-key", "2"], "--max-streams-per-key needs API keys"),
        (["up", "--api-key", "has space"], "API key #1 is empty or holds a character other than"),
        (["gateway", "--api-key-file", "/nonexistent/keys"], "--api-key-file /nonexistent/keys:"),
    ],
)
def test_public_port_settings_that_cannot_work_are_usage_errors(
    argv: list[str], message: str, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [arg.format(ca=pki.ca, server=pki.server, client=pki.client) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("cbserve: error: ") and message in err and "Traceback" not in err, err


def test_api_key_flags_replace_the_variable_and_the_file_adds_to_either(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# tenant beta\n\n  {BETA}\n")
    monkeypatch.setenv("CBSERVE_API_KEYS", f"{ALPHA}, {WRONG}")

    def labels(*argv: str) -> list[str | None]:
        _, access = public_port(build_parser().parse_args(["gateway", *argv]))
        assert access.keys is not None
        return [access.keys.identify(key) for key in (ALPHA, BETA, WRONG)]

    assert labels() == ["key#1", None, "key#2"]
    assert labels("--api-key", BETA) == [None, "key#1", None]
    assert labels("--api-key-file", str(key_file)) == ["key#1", "key#3", "key#2"]


def test_api_keys_are_held_as_digests_and_named_by_position() -> None:
    keys = ApiKeys(split_keys(f" {ALPHA} ,{BETA},,{ALPHA}"))
    assert len(keys) == 2  # a key listed twice is one key
    assert (keys.identify(ALPHA), keys.identify(BETA), keys.identify(WRONG)) == ("key#1", "key#2", None)
    assert keys.identify(ALPHA[:-1]) is None and keys.identify("") is None
    assert ALPHA not in repr(keys) and ALPHA not in repr(vars(keys))


# ------------------------------------------------------------------------------------- TLS, keys


def test_the_port_speaks_tls_only(secure_stack: Stack, pki: Pki) -> None:
    for channel in (
        grpc.insecure_channel(secure_stack.target),
        grpc.secure_channel(secure_stack.target, grpc.ssl_channel_credentials(pki.other_ca.read_bytes())),
    ):
        with channel:
            assert code_of(health_pb2_grpc.HealthStub(channel).Check, HEALTH_CHECK) == UNAVAILABLE
    ids, _, final, _ = secure_stack.generate(greedy_request(prompt(1), 6))
    assert ids == secure_stack.reference(prompt(1), 6)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH


def test_every_method_needs_a_valid_key_before_any_work(secure_stack: Stack) -> None:
    stub = secure_stack.stub
    calls: dict[str, Callable[[Metadata], Any]] = {
        "Generate": lambda md: list(stub.Generate(greedy_request(prompt(2), 4), metadata=md, timeout=30)),
        "GetModelInfo": lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10),
        "GetLoad": lambda md: stub.GetLoad(pb.GetLoadRequest(), metadata=md, timeout=10),
        "Tokenize": lambda md: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md, timeout=10),
    }
    refused: dict[str, Metadata] = {
        "missing": (),
        "wrong": bearer(WRONG),
        "a prefix of a key": bearer(ALPHA[:-1]),
        "not bearer": (("authorization", f"Basic {ALPHA}"),),
        "empty": (("authorization", "Bearer "),),
        "two keys": bearer(WRONG) + bearer(ALPHA),
    }
    before = secure_stack.load()
    for method, call in calls.items():
        for what, metadata in refused.items():
            assert code_of(call, metadata) == UNAUTHENTICATED, (method, what)
    assert secure_stack.load().prefix_cache_queries == before.prefix_cache_queries  # none reached the worker
    for key in (ALPHA, BETA):
        assert code_of(calls["GetModelInfo"], bearer(key)) == OK

    # Before the request is even parsed: bytes that are no GenerateRequest are refused for the key.
    raw = secure_stack.channel.unary_stream(f"/{SERVICE_NAME}/Generate")
    assert code_of(lambda: list(raw(b"\xff\xff", timeout=10))) == UNAUTHENTICATED
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: list(raw(b"\xff\xff", metadata=bearer(BETA), timeout=10))) == invalid


def test_health_reflection_and_metrics_need_no_key(secure_stack: Stack, health_port: int) -> None:
    assert secure_stack.health_status() == "SERVING"  # over TLS, no metadata
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:  # the probes' plaintext port
        reply = health_pb2_grpc.HealthStub(channel).Check(HEALTH_CHECK, timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # ... which serves health alone.
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listing = reflection_pb2.ServerReflectionRequest(list_services="")
        listed = code_of(lambda: list(stub.ServerReflectionInfo(iter([listing]), timeout=10)))
        assert listed == grpc.StatusCode.UNIMPLEMENTED

    stub = reflection_pb2_grpc.ServerReflectionStub(secure_stack.channel)
    (reply,) = stub.ServerReflectionInfo(iter([listing]), timeout=10)
    assert SERVICE_NAME in {s.name for s in reply.list_services_response.service}

    assert code_of(lambda: secure_stack.stub.GetLoad(pb.GetLoadRequest(), timeout=10)) == UNAUTHENTICATED
    url = f"http://127.0.0.1:{secure_stack.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert 'cbserve:request_errors_total{code="UNAUTHENTICATED"}' in response.read().decode()


def test_closed_health_and_reflection_need_a_key(mtls_gateway: Gateway) -> None:
    assert mtls_gateway.health_status() == "UNAUTHENTICATED"
    assert mtls_gateway.health_status(mtls_gateway.metadata) == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(mtls_gateway.channel)
    listing = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    assert code_of(lambda: list(stub.ServerReflectionInfo(listing, timeout=10))) == UNAUTHENTICATED


@pytest.mark.parametrize("client", ["issued by the CA", "from another CA", "none"])
def test_mutual_tls_needs_a_certificate_the_ca_issued(
    mtls_gateway: Gateway, secure_stack: Stack, pki: Pki, client: str
) -> None:
    pair = {"issued by the CA": pki.client, "from another CA": pki.stranger, "none": None}[client]
    credentials = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(),
        pair.key.read_bytes() if pair is not None else None,
        pair.cert.read_bytes() if pair is not None else None,
    )
    request = greedy_request(prompt(3), 5)
    with grpc.secure_channel(mtls_gateway.target, credentials) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        key = mtls_gateway.metadata
        if pair is not pki.client:  # the handshake fails: no call gets as far as its key
            assert code_of(lambda: list(stub.Generate(request, metadata=key, timeout=30))) == UNAVAILABLE
        else:
            assert code_of(lambda: list(stub.Generate(request, timeout=30))) == UNAUTHENTICATED
            ids = streamed_ids(stub.Generate(request, metadata=key, timeout=60))
            assert ids == secure_stack.reference(prompt(3), 5)


def test_the_command_line_client_speaks_tls_and_keys(
    secure_stack: Stack,
    mtls_gateway: Gateway,
    pki: Pki,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mutual = [
        "--target",
        mtls_gateway.target,
        "--tls-ca",
        str(pki.ca),
        "--tls-client-cert",
        str(pki.client.cert),
        "--tls-client-key",
        str(pki.client.key),
    ]
    assert main(["health", *mutual, "--api-key", ALPHA]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(["health", *mutual]) == 1  # health is closed on this gateway
    assert capsys.readouterr().out.strip() == "UNAUTHENTICATED"

    generate = ["generate", "--target", secure_stack.target, "--tls-ca", str(pki.ca), "Hello"]
    monkeypatch.setenv("CBSERVE_API_KEY", WRONG)
    assert main(generate) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    # The right key gets the call to the model, which (the tiny test model has no tokenizer) cannot
    # take text: INVALID_ARGUMENT is the service's own answer.
    monkeypatch.setenv("CBSERVE_API_KEY", ALPHA)
    assert main(generate) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


@needs_node
@pytest.mark.parametrize("key", ["good", "missing", "wrong"])
def test_node_client_over_tls_with_keys(secure_stack: Stack, pki: Pki, node_client: Any, key: str) -> None:
    metadata = {
        "good": {"metadata": f"authorization=Bearer {BETA}"},
        "missing": {},
        "wrong": {"metadata": f"authorization=Bearer {WRONG}"},
    }[key]
    out = node_client(secure_stack.target, request=node_request(prompt(4), 6), tls_ca=str(pki.ca), **metadata)
    if key == "good":
        assert out.get("token_ids") == secure_stack.reference(prompt(4), 6), out
    else:
        assert out.get("error", {}).get("name") == "UNAUTHENTICATED", out
    assert node_client(secure_stack.target, "health", tls_ca=str(pki.ca)) == {"status": "SERVING"}


@needs_node
@pytest.mark.parametrize("client", ["issued by the CA", "from another CA"])
def test_node_client_with_client_certificates(
    mtls_gateway: Gateway, secure_stack: Stack, pki: Pki, node_client: Any, client: str
) -> None:
    pair = pki.client if client == "issued by the CA" else pki.stranger
    out = node_client(
        mtls_gateway.target,
        "model-info",
        tls_ca=str(pki.ca),
        tls_cert=str(pair.cert),
        tls_key=str(pair.key),
        metadata=f"authorization=Bearer {ALPHA}",
    )
    if pair is pki.client:
        assert out.get("vocabSize") == secure_stack.vocab_size, out
    else:
        assert out.get("error", {}).get("name") == "UNAVAILABLE", out


# ----------------------------------------------------------------------------------------- tenants


def test_tenants_share_cached_blocks_only_under_the_same_salt(secure_stack: Stack) -> None:
    """Same prompt three times: tenant alpha salted "a", tenant beta salted "b" (no block shared: no
    prefix hit, and the cachemgr holds a second hashed copy of every page), then beta salted "a"
    (alpha's pages are hit, and the cachemgr holds no new one). kv_blocks_cached is the cachemgr's
    own count of hashed blocks no request uses, read after each request has released its blocks."""
    tokens = prompt(5, 4 * PAGE_SIZE)
    pages = len(tokens) // PAGE_SIZE
    shared = (len(tokens) - 1) // PAGE_SIZE * PAGE_SIZE  # a hit leaves the last token to compute

    def run(key: str, salt: str) -> tuple[int, int, int]:
        """(cached prompt tokens the call reports, prefix-hit tokens, hashed blocks) it added."""
        before = secure_stack.wait_idle()
        request = greedy_request(tokens, 1)
        request.cache_salt = salt
        _, _, final, _ = secure_stack.generate(request, metadata=bearer(key))
        after = secure_stack.wait_idle()
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        return final.usage.cached_prompt_tokens, hits, after.kv_blocks_cached - before.kv_blocks_cached

    assert run(ALPHA, "tenant-a") == (0, 0, pages)
    assert run(BETA, "tenant-b") == (0, 0, pages)
    assert run(BETA, "tenant-a") == (shared, shared, 0)


def test_a_key_over_its_stream_limit_is_refused_while_other_keys_are_served(
    secure_stack: Stack, pki: Pki
) -> None:
    stack = secure_stack
    # Calls that end in an error give their stream back: more bad requests than the limit, one after
    # another, are each refused for what they are.
    for _ in range(MAX_STREAMS + 1):
        bad = greedy_request([1, stack.vocab_size], 4)
        assert code_of(stack.generate, bad) == grpc.StatusCode.INVALID_ARGUMENT

    # Alpha holds its streams open: each has sent its first chunk, and the rest, unread, fills the
    # flow-control window (kept small on this channel), so the gateway cannot end them however fast
    # the model runs.
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.secure_channel(stack.target, tls(pki), options=small_window) as channel:
        stub, held = pb_grpc.TextGenerationStub(channel), []
        for i in range(MAX_STREAMS):
            request = greedy_request(prompt(10 + i), 600)
            request.output.logprobs = 20  # some 200 bytes a token: far more than the window
            held.append(stub.Generate(request, metadata=bearer(ALPHA), timeout=120))
            next(held[-1])

        # Alpha floods; beta, within its own limit, has one request after another served meanwhile.
        flood = [greedy_request(prompt(20 + i), 4) for i in range(12)]
        served = [prompt(40 + i) for i in range(4)]

        def serve_beta() -> list[list[int]]:
            return [stack.generate(greedy_request(p, 4), 60.0, bearer(BETA))[0] for p in served]

        with ThreadPoolExecutor(8) as pool:
            refused = [pool.submit(code_of, stack.generate, r) for r in flood]
            beta = pool.submit(serve_beta)
            assert {f.result() for f in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert beta.result() == [stack.reference(p, 4) for p in served]
        for call in held:
            call.cancel()

    # Cancelled, alpha's streams hold no block, and give their places back as soon as the gateway
    # hears of the cancellations.
    stack.assert_idle()
    deadline = time.monotonic() + 10
    again = greedy_request(prompt(60), 4)
    while (code := code_of(stack.generate, again)) != OK and time.monotonic() < deadline:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        time.sleep(0.1)
    assert code == OK


def test_no_key_is_ever_logged(secure_stack: Stack, mtls_gateway: Gateway) -> None:
    logs = "".join(p.read_text(errors="replace") for p in (secure_stack.log_path, mtls_gateway.log_path))
    assert "request refused" in logs
    for key in (ALPHA, BETA, WRONG):
        assert key not in logs
