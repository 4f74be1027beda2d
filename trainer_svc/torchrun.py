"""torchrun entry of the trainer: one process per GPU, rank 0 serves gRPC and drives the other ranks.

    torchrun --standalone --nproc-per-node 2 -m trainer_svc.torchrun \
        --base-model smollm2-135m-instruct --tensor-parallel-size 2 --registry-address HOST:PORT --port 50052

The same command line as `python -m trainer_svc` (trainer_svc/__main__.py) with the megatron backend as the default;
the backend's own options and launch are its registry entry's (trainer_svc/backends).
"""

from __future__ import annotations

import argparse

from trainer_svc.__main__ import main as _main
from trainer_svc.__main__ import parse_args as _parse_args

PROG = "torchrun ... -m trainer_svc.torchrun"
DEFAULT_BACKEND = "megatron"


def parse_args(argv=None) -> argparse.Namespace:
    return _parse_args(argv, default_backend=DEFAULT_BACKEND, prog=PROG)


def main(argv=None) -> None:
    _main(argv, default_backend=DEFAULT_BACKEND, prog=PROG)


if __name__ == "__main__":
    main()
