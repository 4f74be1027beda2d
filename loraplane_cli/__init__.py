"""The `loraplane` command line (typer + rich)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="loraplane: multi-tenant LoRA post-training control plane.")

# Each command group lives in its own module; importing it attaches its commands to `app`.
from loraplane_cli import cluster, keys, product, train, trainers  # noqa: F401
