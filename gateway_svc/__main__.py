"""`python -m gateway_svc`: serve the gateway with uvicorn (settings from LORAPLANE_GATEWAY_* variables)."""

from __future__ import annotations

import logging

import uvicorn

from gateway_svc.app import create_app
from gateway_svc.config import GatewaySettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                timeout_keep_alive=75)


if __name__ == "__main__":
    main()
