"""`cbserve up`: the three processes on one machine, supervised.

The cachemgr, worker and gateway run as child processes (`cbserve cachemgr|worker|gateway`) on `ipc://`
sockets in a private runtime folder; with `--http-port`, the smg router (router.py) runs in front of the
gateway as a fourth, started once the gateway serves (its ready file), so that the router finds it at
once instead of warning every second that it cannot. Their JSON logs go straight to this terminal's
stderr: stdout holds the gateway's one `serving` line. The router writes its JSON logs to stdout; they
are relayed to stderr with the `service` field every other child's logs carry. A child that dies is
started again (the worker re-attaches to the cachemgr, whose KV pool outlived it), unless it exited with
the configuration-error status (a port in use, a bad setting): then it would fail again, and the whole
stack stops with that status. SIGTERM or Ctrl-C stops the router first, then the gateway, so that it
drains its streams, then the worker, then the cachemgr.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import structlog

from services.common import ready_file
from services.common.cli_args import CONFIG_ERROR_EXIT
from services.common.wire import INTERNAL_KEY_ENV

log = structlog.get_logger(__name__)

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
POLL_S = 0.2


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    due_at: float = 0.0  # when a dead child is started again
    history: list[float] = field(default_factory=list)
    after: Path | None = None  # a ready file (common/ready_file.py): the child starts once it is ready
    foreign_logs: bool = False  # not ours: its stdout is relayed to stderr, tagged `service=name`

    def start(self, env: dict[str, str]) -> None:
        # Own session: a terminal's Ctrl-C reaches only the supervisor, which stops the children in
        # order (gateway first, so it drains) instead of all at once.
        self.process = subprocess.Popen(
            self.argv,
            env=env,
            stdout=subprocess.PIPE if self.foreign_logs else None,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        if self.process.stdout is not None:
            threading.Thread(
                target=relay_logs, args=(self.process.stdout, self.name, sys.stderr), daemon=True
            ).start()
        self.started_at = time.monotonic()
        log.info("started", child=self.name, child_pid=self.process.pid)


def relay_logs(stream: IO[bytes], service: str, out: IO[str]) -> None:
    """Copy a child's log lines to `out` until it closes them: each JSON object gains `service` (as
    structlog's records carry theirs), any other line passes as it is."""
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            record.setdefault("service", service)
            line = json.dumps(record)
        out.write(line + "\n")
        out.flush()


def cbserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("process did not stop; killing it", child_pid=proc.pid)
            proc.kill()
            proc.wait()
    return proc.returncode


def die_with_parent() -> None:
    """`preexec_fn` of a child that must not outlive its parent, even one killed by SIGKILL: Linux
    sends the child SIGTERM when the parent dies (elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class Supervisor:
    def __init__(self, children: Sequence[Child], env: dict[str, str], stop_timeout_s: float) -> None:
        self.children = list(children)
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self.stopping = False
        self.exit_code = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for child in self.children:
            if child.after is None:
                child.start(self.env)
        try:
            while not self.stopping:
                time.sleep(POLL_S)
                self._watch()
        finally:
            self._shutdown()
        return self.exit_code

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _watch(self) -> None:
        now = time.monotonic()
        for child in self.children:
            proc = child.process
            if proc is not None and proc.poll() is not None:
                if proc.returncode == CONFIG_ERROR_EXIT:  # it would fail the same way again
                    log.error("child failed on its configuration; stopping the stack", child=child.name)
                    self.stopping, self.exit_code = True, CONFIG_ERROR_EXIT
                    return
                # Back off when a child keeps dying young; a long healthy run resets the count.
                if now - child.started_at > 60:
                    child.restarts = 0
                delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                log.error("child died; restarting", child=child.name, code=proc.returncode, in_s=delay)
                child.process, child.due_at = None, now + delay
                child.restarts += 1
            if child.process is None and now >= child.due_at:
                if child.after is not None and not ready_file.is_ready(child.after):
                    continue
                child.start(self.env)
                child.history.append(now)

    def _shutdown(self) -> None:
        # The router, then the gateway (it drains), the worker (it releases blocks), the cachemgr.
        for child in reversed(self.children):
            proc = child.process
            if proc is None or proc.poll() is not None:
                continue
            log.info("stopped", child=child.name, code=stop_process(proc, self.stop_timeout_s))


def unavailable_port(host: str, ports: dict[str, int]) -> str | None:
    """Why one of `ports` (flag -> port; 0 is off) cannot be listened on at `host`, or None. Checked
    before any child starts: a gateway that finds its port taken would otherwise find out only
    after the cachemgr had allocated its pool and the worker had loaded the model."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in seen:
            return f"{flag} {port} is also {seen[port]}"
        seen[port] = flag
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind, proto) as probe:
                # As servers bind: a port left in TIME_WAIT by a stopped stack is free to take.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            return f"{flag} {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def run_up(
    model: str | None,
    device: str,
    dtype: str,
    port: int,
    metrics_port: int,  # 0: off
    host: str,
    settings_env: dict[str, str],
    drain_grace_s: float,
    router: Sequence[str] = (),  # the smg command line (router.py); empty: no router
    http_url: str | None = None,  # where the router serves OpenAI's API (the `serving` line names it)
) -> int:
    runtime = Path(tempfile.mkdtemp(prefix="cbserve-"))
    cachemgr_address = f"ipc://{runtime}/cachemgr.sock"
    worker_address = f"ipc://{runtime}/worker.sock"
    env = os.environ | settings_env
    # Only this stack's children know the key, so nothing else on the machine can attach or submit.
    if not env.get(INTERNAL_KEY_ENV):
        env[INTERNAL_KEY_ENV] = secrets.token_hex(16)
    env["CBSERVE_DEVICE"], env["CBSERVE_DTYPE"] = device, dtype
    if model is not None:
        env["CBSERVE_MODEL"] = model
    gateway_ready = runtime / "gateway.ready"
    gateway = [
        "gateway",
        "--worker-address",
        worker_address,
        "--host",
        host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--ready-file",
        str(gateway_ready),
    ]
    if router and http_url:
        gateway += ["--announce-http", http_url]
    children = [
        Child("cachemgr", cbserve_argv("cachemgr", "--cachemgr-address", cachemgr_address)),
        Child(
            "worker",
            cbserve_argv(
                "worker", "--worker-address", worker_address, "--cachemgr-address", cachemgr_address
            ),
        ),
        Child("gateway", cbserve_argv(*gateway)),
    ]
    if router:
        children.append(Child("router", list(router), after=gateway_ready, foreign_logs=True))
    log.info("stack starting", runtime=str(runtime), port=port, metrics_port=metrics_port)
    try:
        return Supervisor(children, env, stop_timeout_s=drain_grace_s + 10).run()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalStack:
    """`cbserve up` as a child process on loopback ports of its own (gRPC and metrics), its settings in
    `env`, its logs in `log_path`: the stack the benchmarks and the integration tests drive. It dies
    with this process, and `stop` ends it as Ctrl-C would."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        env: dict[str, str],
        up_args: Sequence[str] = (),
        cwd: Path | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        self._log = log_path.open("wb")
        argv = cbserve_argv(
            "up",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            *up_args,
        )
        self.process = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=self._log, stderr=self._log, preexec_fn=die_with_parent
        )

    def health_status(self) -> str:
        """The health service's answer (SERVING, NOT_SERVING, or the status code of a failed call);
        each driver asks it over its own channel."""
        raise NotImplementedError

    def wait_serving(self, timeout_s: float = 240.0) -> None:
        """Until the health service says SERVING; an error, with the log's end, if the stack exits
        first or takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.health_status() != "SERVING":
            if self.process.poll() is not None:
                raise RuntimeError(f"stack exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"stack not SERVING after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        code = stop_process(self.process, 60)
        self._log.close()
        return code
