"""Python stubs of the public API, generated from `proto/cbserve/v1/*.proto` in the build.

The .proto files are the contract; the stubs are derived, never committed. The first import after a
change of any .proto compiles them with grpc_tools into `_generated/` (gitignored); later imports
reuse them while the recorded digest of the sources matches. A non-editable install carries the
stubs generated before it was built (`python -m services.gateway.api` generates them). protoc
writes absolute imports (`from cbserve.v1 import ...`), which would need a top-level `cbserve`
package; they are rewritten to relative ones so that the stubs live inside this package.

    from services.gateway.api import pb, pb_grpc
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
GENERATED = Path(__file__).resolve().parent / "_generated"
PROTO_FILE = "cbserve/v1/text_generation.proto"
_DIGEST_FILE = "SOURCE_DIGEST"


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(PROTO_ROOT.rglob("*.proto")):
        h.update(str(path.relative_to(PROTO_ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _compile(digest: str) -> None:
    from grpc_tools import protoc

    staging = Path(tempfile.mkdtemp(prefix="_generated.", dir=GENERATED.parent))
    try:
        include = Path(protoc.__file__).parent / "_proto"  # well-known types
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
        for path in staging.rglob("*.py*"):
            text = re.sub(r"^from cbserve\.v1 import", "from . import", path.read_text(), flags=re.M)
            path.write_text(text)
        for folder in [staging, *[p for p in staging.rglob("*") if p.is_dir()]]:
            (folder / "__init__.py").touch()
        (staging / _DIGEST_FILE).write_text(digest)
        # Concurrent first imports (several processes start at once) each build their own staging
        # folder; the rename makes one of them win whole, never a half-written package.
        old = GENERATED.with_name(f"_generated.old.{os.getpid()}")
        if GENERATED.exists():
            GENERATED.rename(old)
        try:
            staging.rename(GENERATED)
        except OSError:
            pass  # another process installed an identical build first
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load() -> tuple[ModuleType, ModuleType]:
    # An installed (non-editable) copy has no proto/ beside it: it uses the stubs built into it.
    if (PROTO_ROOT / PROTO_FILE).is_file():
        digest = _source_digest()
        stamp = GENERATED / _DIGEST_FILE
        if not stamp.exists() or stamp.read_text() != digest:
            _compile(digest)
    prefix = f"{__package__}._generated.cbserve.v1"
    return (
        importlib.import_module(f"{prefix}.text_generation_pb2"),
        importlib.import_module(f"{prefix}.text_generation_pb2_grpc"),
    )


pb, pb_grpc = _load()
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name


if __name__ == "__main__":
    print(GENERATED)
