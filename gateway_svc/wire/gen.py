"""Regenerate gateway_svc/wire/tinker_wire_pb2.py(.pyi) from tinker_wire.proto, as scripts/gen_protos.py does for the
gRPC contract. `--check` exits non-zero when the committed stub is stale (run by `make protos-check`)."""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
WIRE = Path("gateway_svc") / "wire"
GENERATED = ("tinker_wire_pb2.py", "tinker_wire_pb2.pyi")


def generate(out_dir: Path) -> None:
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--mypy_out={out_dir}",
            str(WIRE / "tinker_wire.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if opts.check:
            stale = [n for n in GENERATED if not (ROOT / WIRE / n).exists()
                     or not filecmp.cmp(Path(tmp) / WIRE / n, ROOT / WIRE / n, shallow=False)]
            if stale:
                print("stale gateway wire stubs (run `make protos`): " + ", ".join(stale))
                return 1
            print(f"{len(GENERATED)} gateway wire stubs are up to date")
            return 0
        for name in GENERATED:
            shutil.copy2(Path(tmp) / WIRE / name, ROOT / WIRE / name)
        print(f"wrote {len(GENERATED)} stubs to {WIRE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
