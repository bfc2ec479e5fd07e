"""``python -m lamina.services.telemetry``"""

import sys

from lamina.libs.config import parse_config
from lamina.libs.service import run
from lamina.services.telemetry.service import TelemetryConfig, TelemetryService


def main(argv: list[str] | None = None) -> int:
    return run(
        "telemetry", TelemetryService(parse_config(TelemetryConfig, argv, prog="lamina telemetry"))
    )


if __name__ == "__main__":
    sys.exit(main())
