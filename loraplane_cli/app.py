"""The `loraplane` typer application that every command module attaches its commands to (a module of its own, so
the command modules do not import the package that imports them)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="loraplane: multi-tenant LoRA post-training control plane.")
