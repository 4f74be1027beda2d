"""Regenerate the committed Python stubs in loraplane/v1 from protos/ (grpcio-tools + mypy-protobuf).

`--check` generates into a temporary directory and exits non-zero if the committed stubs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("loraplane") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.glob("loraplane/v1/*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    # protoc finds protoc-gen-mypy on PATH; it lives beside the interpreter running this script.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (out_dir / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def committed_stubs() -> list[Path]:
    return sorted(p for p in (ROOT / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        if opts.check:
            fresh_names = {p.name for p in fresh}
            committed_names = {p.name for p in committed_stubs()}
            stale = sorted(fresh_names ^ committed_names)
            stale += [p.name for p in fresh if p.name in committed_names
                      and not filecmp.cmp(p, ROOT / PACKAGE_DIR / p.name, shallow=False)]
            if stale:
                print("stale generated stubs (run `make protos`): " + ", ".join(sorted(set(stale))))
                return 1
            print(f"{len(fresh)} generated stubs are up to date")
            return 0
        for old in committed_stubs():
            old.unlink()
        for path in fresh:
            shutil.copy2(path, ROOT / PACKAGE_DIR / path.name)
        print(f"wrote {len(fresh)} stubs to {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
