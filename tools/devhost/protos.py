"""Message classes for driving azure-functions-runtime in-process.

The runtime reads fields off real protobuf messages (``WhichOneof``, defaults for every unset
field), so plain objects will not do. ``worker.proto`` holds our own minimal schema; it is compiled
with grpcio-tools into ``_generated/`` on first use and whenever the .proto changes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
_PROTO = _HERE / "worker.proto"
_OUT = _HERE / "_generated"


def _compile(target: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        rc = protoc.main(["protoc", f"-I{_HERE}", f"-I{include}", f"--python_out={tmp}", str(_PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) compiling {_PROTO}")
        os.replace(Path(tmp) / "worker_pb2.py", target / "worker_pb2.py")


def load() -> ModuleType:
    """Return the compiled ``worker_pb2`` module, compiling it if it is missing or stale."""
    digest = hashlib.sha256(_PROTO.read_bytes()).hexdigest()[:16]
    module_file = _OUT / "worker_pb2.py"
    stamp = _OUT / "worker.proto.sha"
    if not module_file.exists() or not stamp.exists() or stamp.read_text() != digest:
        _compile(_OUT)
        stamp.write_text(digest)
    name = "devhost._generated.worker_pb2"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, module_file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
