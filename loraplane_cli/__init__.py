"""The `loraplane` command line (typer + rich). Each command group lives in its own module; importing it attaches
its commands to `app` (loraplane_cli/app.py)."""

from __future__ import annotations

from loraplane_cli import adapter_io, cluster, keys, product, train, trainers  # noqa: F401
from loraplane_cli.app import app

__all__ = ["app"]
