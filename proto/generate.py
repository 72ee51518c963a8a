"""Regenerate kvferry/proto/v1 from proto/kvferry/v1/*.proto: ``python proto/generate.py [OUT]``.

protoc names a generated module after its file's path (kvferry/v1/x.proto -> kvferry.v1.x_pb2),
which would be a package beside kvferry's own modules; the imports are rewritten to the package
the code is committed in, kvferry.proto.v1. Needs grpcio-tools (the test extra).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "proto"
PACKAGE = "kvferry.proto.v1"
HEADER = "# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.\n"


def generate(out: Path) -> list[Path]:
    """Write the generated modules into ``out``; returns their paths."""
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(SOURCES)) for p in (SOURCES / "kvferry" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{SOURCES}", f"--python_out={raw}", f"--pyi_out={raw}", f"--grpc_python_out={raw}",
                *files]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted((Path(raw) / "kvferry" / "v1").iterdir()):
            text = re.sub(r"^from kvferry\.v1 import", f"from {PACKAGE} import", path.read_text(), flags=re.M)
            target = out / path.name
            target.write_text(HEADER + text)
            written.append(target)
        (out / "__init__.py").write_text(HEADER + '"""Messages and service stubs of kvferry.v1."""\n')
        return [*written, out / "__init__.py"]


if __name__ == "__main__":
    destination = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "kvferry" / "proto" / "v1"
    for path in generate(destination):
        print(path)
