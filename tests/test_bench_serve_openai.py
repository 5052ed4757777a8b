"""`cbserve bench serve --backend openai`: against an OpenAI-style server of this test (http.server
in a thread, streaming known events at known times, failing on request), and through a real smg in
front of a tiny-model stack (`cbserve up --http-port`). Also its parts: prompts written as text, the
server's load read from cbserve's or vLLM's Prometheus metrics."""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from services.bench.serve.metrics import parse_load
from services.bench.serve.text import PromptText
from services.bench.serve.workloads import phase_rng, random_requests
from services.cli import main
from services.common.gateway_messages import Load
from services.gateway.metrics import GatewayMetrics
from services.supervisor import free_port
from tests.stack import Stack

# ------------------------------------------------------------------------------- a tokenizer of ours

WORDS = "the cat sat on a mat while dogs ran over hills and rivers under bright stars".split()


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained here on a few words (GPT-2's kind, as SmolLM2's): the
    words are tokens of their own, " cat" among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 5
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)
    return path


def test_prompts_are_written_as_words_read_back_exactly(bpe_dir: Path) -> None:
    plain = PromptText(bpe_dir, "")
    tokenizer = plain.tokenizer
    assert {text.strip() for _, text in plain.words} == set(WORDS) - {"a"}  # one letter: not a word
    assert plain.vocab_size == len(tokenizer)  # no config.json beside it
    prefix, a, b = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], [8, 9, 7, 9, 3]
    for ids in (prefix + a, prefix + b, list(range(300))):
        assert len(tokenizer.encode(plain.words_for(ids), add_special_tokens=False)) == len(ids)
    shared = tokenizer.encode(plain.words_for(prefix), add_special_tokens=False)
    assert tokenizer.encode(plain.words_for(prefix + a), add_special_tokens=False)[:8] == shared
    # A run's salt writes the same ids in other words; the same salt in the same ones.
    salted = PromptText(bpe_dir, "5eed")
    assert salted.words_for(prefix) != plain.words_for(prefix)
    assert salted.words_for(prefix) == PromptText(bpe_dir, "5eed").words_for(prefix)


def test_a_tokenizer_without_word_tokens_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # tokens without their space: "cat"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}: its tokenizer has no word tokens"):
        PromptText(tmp_path, "")


# ------------------------------------------------------------------------- load from the metrics


def vllm_metrics(running: int = 3, waiting: int = 1, queries: int = 1200) -> str:
    """vLLM's names and labels (0.32), as its API server exposes them."""
    return f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.25
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="400",prefix_caching="True"}} 1.0
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}.0
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 800.0
vllm:num_preemptions_total{{engine="0",model_name="m"}} 2.0
vllm:generation_tokens_total{{engine="0",model_name="m"}} 5000.0
"""


VLLM_METRICS = vllm_metrics()


def test_load_from_vllm_and_cbserve_metrics() -> None:
    assert parse_load(VLLM_METRICS) == {
        "kv_blocks_used": 100,
        "kv_blocks_total": 400,
        "requests_running": 3,
        "requests_waiting": 1,
        "prefix_cache_queries": 1200,
        "prefix_cache_hits": 800,
        "offloads": 0,
        "soft_resets": 2,
    }
    # Two engines (vLLM's data parallel): their blocks and requests add up.
    second = VLLM_METRICS.replace('engine="0"', 'engine="1"').replace("0.25", "0.5")
    both = parse_load(VLLM_METRICS + second)
    assert both is not None and both["kv_blocks_used"] == 100 + 200 and both["kv_blocks_total"] == 800
    assert both["requests_running"] == 6 and both["prefix_cache_hits"] == 1600

    load = Load(
        requests_running=2,
        requests_waiting=5,
        kv_blocks_used=30,
        kv_blocks_total=120,
        prefix_cache_queries=640,
        prefix_cache_hits=512,
        offloads=1,
        soft_resets=4,
    )
    text = generate_latest(GatewayMetrics(lambda: load).registry).decode()
    assert parse_load(text) == {
        "kv_blocks_used": 30,
        "kv_blocks_total": 120,
        "requests_running": 2,
        "requests_waiting": 5,
        "prefix_cache_queries": 640,
        "prefix_cache_hits": 512,
        "offloads": 1,
        "soft_resets": 4,
    }
    assert parse_load("smg_http_requests_total 3\n") is None  # a router's own metrics


# ---------------------------------------------------------------------- an OpenAI server of ours

FIRST_DELAY_S, GAP_S = 0.05, 0.03
TEXTS = [" one", " two", "", " three", " four", " five"]  # "": a token without text sends no chunk


class FakeOpenAI(ThreadingHTTPServer):
    """/v1/models, /metrics (vLLM's names) and streaming /v1/completions; what a completion does
    depends on its prompt: "http-400", "http-503", "truncate" (ends without [DONE]), "cut" (the
    connection drops mid-body), "error-event", "not-sse", "slow" (streams until the client goes);
    any other prompt gets TEXTS after FIRST_DELAY_S then one every GAP_S. Usage counts a prompt's
    words as its tokens."""

    daemon_threads = True

    def __init__(self, first_delay_s: float = FIRST_DELAY_S, gap_s: float = GAP_S) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.first_delay_s, self.gap_s = first_delay_s, gap_s
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.lock = threading.Lock()
        self.bodies: list[dict[str, Any]] = []
        self.running = 0
        self.queries = 0
        self.disconnects = 0

    def metrics(self) -> str:
        with self.lock:
            return vllm_metrics(running=self.running, waiting=0, queries=self.queries)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAI

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]})
        elif self.path == "/metrics":
            self._send(200, "text/plain", self.server.metrics().encode())
        else:
            self._json(404, {"error": {"message": f"no {self.path}"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        with self.server.lock:
            self.server.bodies.append(body)
        if prompt == "http-400":
            self._json(400, {"error": {"message": f"bad prompt {prompt!r}", "code": 400}})
        elif prompt == "http-503":
            self._send(503, "text/plain", b"overloaded, come back later")
        elif prompt == "not-sse":
            self._json(200, {"choices": [{"text": "whole"}]})
        else:
            with self.server.lock:
                self.server.running += 1
                self.server.queries += len(prompt.split())
            try:
                self._stream(prompt, len(prompt.split()))
            except (BrokenPipeError, ConnectionResetError):
                with self.server.lock:
                    self.server.disconnects += 1
            finally:
                with self.server.lock:
                    self.server.running -= 1

    def _stream(self, prompt: str, prompt_tokens: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if prompt == "error-event":
            self._event({"error": {"message": "the engine died", "type": "InternalServerError"}})
            self._event("[DONE]")
        elif prompt == "slow":
            for _ in range(500):  # 10 s at most: the client goes first
                self._event({"choices": [{"index": 0, "text": " x", "finish_reason": None}]})
                time.sleep(0.02)
        else:
            time.sleep(self.server.first_delay_s)
            for i, text in enumerate(TEXTS):
                if text:
                    self._event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
                if prompt == "cut" and i == 1:
                    self.wfile.write(b"40\r\ndata: {")  # a chunk cut short
                    self.wfile.flush()
                    self.close_connection = True
                    return
                time.sleep(self.server.gap_s)
            if prompt == "truncate":
                self._end()
                return
            self._event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(TEXTS),
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            self._event({"choices": [], "usage": usage})
            self._event("[DONE]")
        self._end()

    def _event(self, data: Any) -> None:
        payload = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _json(self, status: int, value: Any) -> None:
        self._send(status, "application/json", json.dumps(value).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serving(server: FakeOpenAI) -> Iterator[FakeOpenAI]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    with serving(FakeOpenAI()) as server:
        yield server


def _bench(tmp_path: Path, target: str, tokenizer: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "report.json"
    code = main(
        [
            "bench",
            "serve",
            "--backend",
            "openai",
            "--target",
            target,
            "--tokenizer",
            str(tokenizer),
            "--json",
            str(out),
            "--no-progress",
            *args,
        ]
    )
    return code, json.loads(out.read_text()) if out.exists() else {}


def _dataset(tmp_path: Path, *prompts: str) -> list[str]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": len(TEXTS)}) + "\n" for p in prompts))
    return ["--workload", "jsonl", "--dataset", str(path), "--num-requests", str(len(prompts))]


def test_a_known_stream_is_timed_as_sent(
    fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _bench(
        tmp_path,
        fake.url,
        bpe_dir,
        *_dataset(tmp_path, "ok one", "ok two", "ok three"),
        "--concurrency",
        "1",
        "--temperature",
        "0.5",
        "--seed",
        "7",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["backend"] == f"openai {fake.url}/v1/completions" and phase["load_source"] is None
    assert phase["requests"]["completed"] == 3 and phase["kv"] is None and phase["load_deltas"] is None
    gaps = []
    for record in phase["records"]:
        times = record["chunk_times"]
        assert record["chunk_tokens"] == [1] * 5 and record["output_tokens"] == 6  # usage counts the sixth
        assert record["prompt_tokens"] == 2 and record["finish_reason"] == "length"
        # No chunk can be seen before the server sent it: the first after its delay, the last after
        # five gaps more (the token without text among them).
        assert FIRST_DELAY_S <= record["ttft"] < FIRST_DELAY_S + 1.0
        assert times[-1] - record["start"] >= FIRST_DELAY_S + 5 * GAP_S
        gaps.append([b - a for a, b in itertools.pairwise(times)])
    # A gap seen late shortens the next one, so only what most gaps say is checked: one GAP_S each,
    # and two for the one spanning the token without text.
    assert statistics.median(g for four in gaps for g in (four[0], *four[2:])) >= GAP_S * 0.9, gaps
    assert statistics.median(four[1] for four in gaps) >= 2 * GAP_S * 0.9, gaps
    assert phase["latency_s"]["itl"]["count"] == 3 * 4
    # The warm-up, then the three in the order sent (one at a time): what each body asked for.
    warm, *sent = fake.bodies
    assert [b["prompt"] for b in sent] == ["ok one", "ok two", "ok three"]
    for body in fake.bodies:
        assert body["model"] == "fake" and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.5
    assert len(warm["prompt"].split()) == 16 and warm["max_tokens"] == 2
    assert [b["seed"] for b in sent] == [7 * 1_000_003 + i for i in range(3)]
    printed = capsys.readouterr()
    assert "unknown (needs --metrics-url)" in printed.out
    assert "warning" not in printed.err  # the server counted the warm-up's words as its tokens


def test_the_load_comes_from_the_metrics(fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path) -> None:
    code, report = _bench(
        tmp_path,
        fake.url,
        bpe_dir,
        "--num-requests",
        "4",
        "--input-len",
        "10",
        "--output-len",
        "6",
        "--concurrency",
        "2",
        "--load-interval",
        "0.01",
        "--metrics-url",
        f"{fake.url}/metrics",
        "--no-warmup",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["load_source"] == f"metrics {fake.url}/metrics"
    assert phase["kv"]["blocks_total"] == 400 and phase["kv"]["peak_blocks_used"] == 100
    assert 1 <= phase["kv"]["peak_running"] <= 2
    assert phase["load_deltas"]["prefix_cache_queries"] == 4 * 10  # the prompts' words, as sent
    assert [r["prompt_tokens"] for r in phase["records"]] == [10] * 4


def test_failures_are_counted_by_kind(fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path) -> None:
    prompts = ("http-400", "http-503", "truncate", "cut", "error-event", "not-sse", "ok")
    code, report = _bench(tmp_path, fake.url, bpe_dir, *_dataset(tmp_path, *prompts), "--no-warmup")
    assert code == 1  # a request failed
    [phase] = report["phases"]
    assert phase["requests"]["completed"] == 1
    assert phase["requests"]["failed"] == {
        "HTTP_400": 1,
        "HTTP_503": 1,
        "TRUNCATED": 2,
        "STREAM_ERROR": 1,
        "BAD_STREAM": 1,
    }
    errors = {r["error_code"] + ":" + str(r["index"]): r["error"] for r in phase["records"] if r["error"]}
    assert errors["HTTP_400:0"] == "bad prompt 'http-400'"
    assert errors["HTTP_503:1"] == "overloaded, come back later"
    assert "[DONE]" in errors["TRUNCATED:2"] and "RemoteProtocolError" in errors["TRUNCATED:3"]
    assert "the engine died" in errors["STREAM_ERROR:4"] and "event-stream" in errors["BAD_STREAM:5"]
    truncated = phase["records"][2]
    assert len(truncated["chunk_times"]) == 5 and truncated["output_tokens"] == 5  # what came, no usage


def test_the_time_limit_closes_the_connections(fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path) -> None:
    code, report = _bench(
        tmp_path,
        fake.url,
        bpe_dir,
        *_dataset(tmp_path, *["slow"] * 6),
        "--concurrency",
        "2",
        "--duration",
        "0.3",
        "--no-warmup",
    )
    assert code == 0
    counts = report["phases"][0]["requests"]
    assert counts["cancelled"] == 2 and counts["not_sent"] == 4 and counts["failed"] == {}
    deadline = time.monotonic() + 5
    while fake.disconnects < 2:  # the server's next write finds the connection closed
        assert time.monotonic() < deadline, fake.disconnects
        time.sleep(0.02)
    assert fake.running == 0


def test_unreachable_and_misnamed_servers_are_refused(
    fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    assert _bench(tmp_path, nobody, bpe_dir)[0] == 1
    assert f"{nobody}/v1/models: ConnectError" in capsys.readouterr().err
    assert _bench(tmp_path, fake.url, bpe_dir, "--served-model-name", "other")[0] == 1
    assert "no model 'other'; the server lists ['fake']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"needs --target http://HOST:PORT, got 127\.0\.0\.1:8000"):
        _bench(tmp_path, "127.0.0.1:8000", bpe_dir)
    with pytest.raises(SystemExit, match="--backend openai needs --tokenizer"):
        main(["bench", "serve", "--backend", "openai", "--target", fake.url])


def test_two_servers_side_by_side(bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--baseline: both servers run the phase each round, the first of a round going second in the
    next; each round writes its prompts in other words, the same for both; the table gives medians,
    their ratio and the rounds in which the target was ahead."""
    slow = FakeOpenAI(first_delay_s=3 * FIRST_DELAY_S, gap_s=2 * GAP_S)
    with serving(FakeOpenAI()) as fast, serving(slow):
        code, report = _bench(
            tmp_path,
            fast.url,
            bpe_dir,
            "--baseline",
            slow.url,
            "--repeat",
            "3",
            "--labels",
            "ours,theirs",
            "--num-requests",
            "4",
            "--concurrency",
            "2",
            "--input-len",
            "5",
            "--output-len",
            "6",
            "--baseline-metrics-url",
            f"{slow.url}/metrics",
            "--load-interval",
            "0.01",
        )
    assert code == 0
    [phase] = report["phases"]
    assert phase["labels"] == ["ours", "theirs"]
    assert [(run["round"], run["side"]) for run in phase["runs"]] == [
        (0, "target"),
        (0, "baseline"),
        (1, "baseline"),
        (1, "target"),
        (2, "target"),
        (2, "baseline"),
    ]
    assert all(run["requests"]["completed"] == 4 for run in phase["runs"])
    # The baseline's load came from its metrics, the target's is unknown (none given).
    known = [run["load_source"] is not None for run in phase["runs"]]
    assert known == [False, True, True, False, False, True]
    # The warm-up once per server, then 4 prompts a round: the same words on both sides, new words
    # each round.
    assert [len(b["prompt"].split()) for b in fast.bodies] == [16] + [5] * 12
    ours = [sorted(b["prompt"] for b in fast.bodies[1 + 4 * r : 5 + 4 * r]) for r in range(3)]
    theirs = [sorted(b["prompt"] for b in slow.bodies[1 + 4 * r : 5 + 4 * r]) for r in range(3)]
    assert ours == theirs and len({tuple(prompts) for prompts in ours}) == 3
    table = {row["metric"]: row for row in phase["comparison"]}
    runs = {(run["round"], run["side"]): run for run in phase["runs"]}
    for metric, key in (("output tok/s", "output_tokens_per_s"),):
        row = table[metric]
        assert row["target"] == statistics.median(runs[r, "target"]["throughput"][key] for r in range(3))
        assert row["ratio"] == pytest.approx(row["target"] / row["baseline"])
        assert row["rounds_ahead"] == 3 and row["rounds"] == 3 and row["ratio"] > 1.2
    ttft = table["TTFT p50 (ms)"]  # in ms, as its name says
    ttfts = [runs[r, "baseline"]["latency_s"]["ttft"]["p50"] * 1000 for r in range(3)]
    assert ttft["baseline"] == pytest.approx(statistics.median(ttfts))
    assert min(ttfts) >= 3 * FIRST_DELAY_S * 1000
    assert ttft["rounds_ahead"] == 3 and ttft["ratio"] < 0.8
    assert table["ITL p50 (ms)"]["rounds_ahead"] == 3
    printed = capsys.readouterr().out
    assert "round 3/3 theirs" in printed
    assert "ours vs theirs, medians of 3 rounds" in printed and "3/3" in printed


def test_a_comparison_reports_a_server_whose_requests_all_fail(
    fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No request of either side gets a token: the rounds and the table say so, and the exit status."""
    code, report = _bench(
        tmp_path,
        fake.url,
        bpe_dir,
        *_dataset(tmp_path, "http-400", "http-503"),
        "--baseline",
        fake.url,
        "--repeat",
        "2",
        "--no-warmup",
    )
    assert code == 1
    [phase] = report["phases"]
    assert [run["requests"]["failed"] for run in phase["runs"]] == [{"HTTP_400": 1, "HTTP_503": 1}] * 4
    ttft = {row["metric"]: row for row in phase["comparison"]}["TTFT p99 (ms)"]
    assert ttft["target"] is None and ttft["ratio"] is None and ttft["rounds"] == 0
    printed = capsys.readouterr().out
    assert "round 2/2 target" in printed and "TTFT p50/p99 -/- ms" in printed


def test_a_comparison_needs_two_servers_of_one_model(
    fake: FakeOpenAI, bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="--repeat compares rounds: it needs --baseline"):
        _bench(tmp_path, fake.url, bpe_dir, "--repeat", "2")
    with pytest.raises(SystemExit, match=r"needs --baseline http://HOST:PORT, got 127\.0\.0\.1:8000"):
        _bench(tmp_path, fake.url, bpe_dir, "--baseline", "127.0.0.1:8000")
    with pytest.raises(SystemExit, match="--plot draws one server"):
        _bench(tmp_path, fake.url, bpe_dir, "--baseline", fake.url, "--plot", str(tmp_path / "p.png"))
    nobody = f"http://127.0.0.1:{free_port()}"
    assert _bench(tmp_path, fake.url, bpe_dir, "--baseline", nobody, "--num-requests", "1")[0] == 1
    assert f"{nobody}/v1/models: ConnectError" in capsys.readouterr().err


# ------------------------------------------------------------------------------ through a real smg


@pytest.fixture(scope="module")
def routed(tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    """`cbserve up --http-port` on the tiny Llama over SmolLM2's tokenizer: (the stack, smg's port)."""
    from tests.smg_router import routed_stack

    with routed_stack(tiny_text_model, tmp_path_factory.mktemp("routed")) as started:
        yield started


@pytest.mark.slow  # a stack and smg start in about 20 s here, and the three runs take 10 more
def test_through_smg(routed: tuple[Stack, int], tmp_path: Path) -> None:
    """smg reads the prompts written as text back as the tokens drawn (usage), forwards ignore_eos
    (every output exactly max_tokens) and says what the prefix cache served; the stack's metrics give
    the load; at the time limit, closing the connections frees the stack's requests."""
    stack, http = routed
    target, metrics = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{stack.metrics_port}/metrics"

    def bench(*args: str) -> tuple[int, dict[str, Any]]:
        return _bench(tmp_path, target, stack.model_dir, *args)

    # 128 tokens a request: a run of seconds, in which the samples of the metrics cannot miss every
    # step that holds blocks.
    code, report = bench(
        "--num-requests",
        "12",
        "--input-len",
        "16",
        "--output-len",
        "128",
        "--range-ratio",
        "0.5",
        "--concurrency",
        "4",
        "--metrics-url",
        metrics,
        "--load-interval",
        "0.01",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["requests"]["completed"] == 12 and phase["requests"]["length_mismatch"] == []
    drawn = random_requests(12, 16, 128, 0.5, stack.vocab_size, phase_rng(0, 0, "workload"))
    assert [r["prompt_tokens"] for r in phase["records"]] == [len(r.token_ids) for r in drawn]  # usage
    assert phase["load_deltas"]["prefix_cache_queries"] == phase["tokens"]["prompt"]
    assert phase["kv"]["peak_blocks_used"] > 0, (phase["kv"], phase["duration_s"])
    assert phase["step_profile"]

    code, report = bench(
        "--workload",
        "shared-prefix",
        "--num-requests",
        "8",
        "--num-groups",
        "2",
        "--prefix-len",
        "32",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--concurrency",
        "2",
    )
    assert code == 0
    prefix = report["phases"][0]["prefix_cache"]
    assert prefix["shared_tokens"] == 6 * 32 and prefix["hit_rate"] > 0.5

    code, report = bench(
        "--num-requests",
        "20",
        "--concurrency",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "1000",
        "--duration",
        "0.5",
        "--no-warmup",
    )
    assert code == 0 and report["phases"][0]["requests"]["cancelled"] == 2
    stack.wait_idle(timeout_s=5)
    stack.assert_idle()
