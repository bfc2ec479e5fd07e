"""``python -m lamina.services.engine_worker``"""

import sys

from lamina.libs.config import parse_config
from lamina.libs.service import run
from lamina.services.engine_worker.service import WorkerConfig, WorkerService


def main(argv: list[str] | None = None) -> int:
    config = parse_config(WorkerConfig, argv, prog="lamina worker")
    return run("engine-worker", WorkerService(config))


if __name__ == "__main__":
    sys.exit(main())
