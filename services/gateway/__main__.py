"""``python -m lamina.services.gateway``"""

import sys

from lamina.libs.config import parse_config
from lamina.libs.service import run
from lamina.services.gateway.service import GatewayConfig, GatewayService


def main(argv: list[str] | None = None) -> int:
    return run("gateway", GatewayService(parse_config(GatewayConfig, argv, prog="lamina gateway")))


if __name__ == "__main__":
    sys.exit(main())
