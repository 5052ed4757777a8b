"""Every native kernel source compiles for every vector path, including those this CPU cannot run.

The tests of a path run only where a CPU has it (or holds a build below its best, `CBSERVE_CPU_ISA`),
and a build that fails falls back to torch's kernels, so a path's compile error would pass unseen on
every machine without it. Here each source is compiled, without code generation (`-fsyntax-only`:
parsing and every template instantiation), with the flags its real build takes for CPUs of each
path's kind."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from services.worker import kernels

SOURCES = sorted((Path(kernels.__file__).parent / "csrc").glob("*.cpp"))
INCLUDES = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]

# (the path a build is held to, a CPU of its kind): every `#if` branch of the sources is taken by one.
TARGETS = [
    ("native", "sapphirerapids"),  # AVX-512 with BF16, VNNI and AMX
    pytest.param("portable", "x86-64", marks=pytest.mark.slow),  # as its other tests
    pytest.param("avx512", "sapphirerapids", marks=pytest.mark.slow),  # AVX-512 alone
    pytest.param("native", "alderlake", marks=pytest.mark.slow),  # AVX2 with AVX-VNNI
    pytest.param("native", "haswell", marks=pytest.mark.slow),  # AVX2 and FMA alone
]


@pytest.mark.skipif(not kernels.compiler_available(), reason="no C++ compiler")
@pytest.mark.parametrize(("path", "march"), TARGETS)
def test_every_source_compiles_for(path: str, march: str) -> None:
    runs = {
        source.stem: subprocess.Popen(
            [
                "c++",
                "-fsyntax-only",
                "-std=c++20",
                "-DTORCH_EXTENSION_NAME=compile_check",
                *kernels.compile_flags(source.stem, path, march),
                *INCLUDES,
                str(source),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for source in SOURCES
    }
    errors = {stem: run.communicate(timeout=300)[0] for stem, run in runs.items()}
    failed = {
        stem: out[-3000:] for stem, run in runs.items() if run.returncode != 0 for out in [errors[stem]]
    }
    assert not failed, failed
    assert set(runs) >= {"fused_ops", "paged_attention", "panel_linear"}


@pytest.mark.skipif(not kernels.compiler_available(), reason="no C++ compiler")
def test_a_kernels_build_tracks_every_local_header_the_compiler_reads() -> None:
    """A kernel is rebuilt when a file its build reads changes (kernels._source_files), so those files
    must be all the csrc headers the compiler reads for it, included through other headers too."""
    csrc = SOURCES[0].parent
    for source in SOURCES:
        deps = subprocess.run(
            ["c++", "-MM", "-std=c++20", *kernels.compile_flags(source.stem, "native"), *INCLUDES, source],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        read = {Path(word) for word in deps.replace("\\\n", " ").split()[1:]}
        local = {path.resolve() for path in read if path.resolve().parent == csrc.resolve()}
        assert {path.resolve() for path in kernels._source_files(source.stem)} == local, source.stem
