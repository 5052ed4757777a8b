"""`make serve` on a fresh machine: which torch it installs (TORCH_VARIANT), and that serving installs
the runtime dependencies alone. Run through the real Makefile with `make` (dry runs: nothing installs)."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
VERSION = "2.13.0"


def make(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PATH": path} if path is not None else dict(os.environ)
    return subprocess.run(
        ["make", "-s", "--no-print-directory", f"PY={sys.executable}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def fake_nvidia_smi(tmp_path: Path, works: bool) -> str:
    """A PATH whose `nvidia-smi -L` lists a GPU (or fails, as on a machine whose driver is gone)."""
    bin_dir = tmp_path / ("gpu" if works else "broken")
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n" if works else "#!/bin/sh\nexit 9\n")
    tool.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.fixture(scope="module")
def cpu_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A wheel index that answers (an empty folder served over HTTP)."""
    root = tmp_path_factory.mktemp("index")
    (root / "whl" / "cpu").mkdir(parents=True)
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def requirement(*args: str, path: str | None = None) -> str:
    done = make("torch-requirement", *args, path=path)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_cpu_is_pinned_to_the_cpu_build_from_the_cpu_index(cpu_index: str) -> None:
    assert requirement("TORCH_VARIANT=cpu", f"TORCH_CPU_INDEX={cpu_index}") == (
        f"torch=={VERSION}+cpu --extra-index-url {cpu_index}"
    )
    # An index out of reach is not passed (pip would retry it for minutes); the pin still keeps the
    # CUDA build out, whatever else pip is configured to search.
    assert (
        requirement("TORCH_VARIANT=cpu", "TORCH_CPU_INDEX=http://127.0.0.1:9/whl/cpu")
        == f"torch=={VERSION}+cpu"
    )


def test_cuda_is_the_package_indexs_build() -> None:
    assert requirement("TORCH_VARIANT=cuda") == f"torch=={VERSION}"


def test_auto_follows_the_gpu(tmp_path: Path) -> None:
    assert requirement(path=fake_nvidia_smi(tmp_path, works=True)) == f"torch=={VERSION}"
    unreachable = "TORCH_CPU_INDEX=http://127.0.0.1:9/whl/cpu"
    assert requirement(unreachable, path=fake_nvidia_smi(tmp_path, works=False)) == f"torch=={VERSION}+cpu"


def test_an_unknown_variant_is_refused() -> None:
    done = make("torch-requirement", "TORCH_VARIANT=gpu")
    assert done.returncode != 0
    assert "TORCH_VARIANT must be cpu, cuda or auto, got 'gpu'" in done.stderr


def test_serve_installs_the_runtime_set_and_test_adds_the_tools() -> None:
    serve = make("-n", "-B", "serve")
    assert serve.returncode == 0, serve.stderr
    assert "pip install --quiet -e ." in serve.stdout and "[test]" not in serve.stdout
    lint = make("-n", "-B", "lint")  # what `make test` installs before it runs the suite
    assert "pip install --quiet -e '.[test]'" in lint.stdout
