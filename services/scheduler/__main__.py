"""``python -m lamina.services.scheduler``"""

import sys

from lamina.libs.config import parse_config
from lamina.libs.service import run
from lamina.services.scheduler.service import SchedulerConfig, SchedulerService


def main(argv: list[str] | None = None) -> int:
    return run(
        "scheduler", SchedulerService(parse_config(SchedulerConfig, argv, prog="lamina scheduler"))
    )


if __name__ == "__main__":
    sys.exit(main())
