"""``lamina ctl``: operate a running cluster over NATS.

``status`` asks a scheduler (``sched.status``) for its view and prints one line per
worker. ``drain``, ``resume``, ``cordon``, ``uncordon`` and ``reset-prefix-cache`` send
that control command to each named worker (or ``--all`` the scheduler knows) on
``worker.<id>.control`` and print its acknowledgement. Exit status 1 when anything
failed: no scheduler, an unknown worker, a worker that did not answer or refused.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from lamina.libs.bus import Bus, NatsConfig
from lamina.libs.config import add_arguments, from_arguments, lamina_home
from lamina.libs.errors import BadReply, NoResponders, NotAdmitted, RequestTimeout
from lamina.libs.telemetry_setup import setup_tracing, shutdown_tracing
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import (
    ControlAck,
    Cordon,
    Drain,
    ResetPrefixCache,
    Resume,
    Uncordon,
)
from lamina.schemas.v1.stats import ClusterStatus, ClusterStatusRequest
from lamina.services import up_state

tracer = trace.get_tracer("lamina.ctl")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
"""Where ``lamina up`` puts its bus by default."""

COMMANDS: dict[str, Callable[[], object]] = {
    "drain": Drain,
    "resume": Resume,
    "cordon": Cordon,
    "uncordon": Uncordon,
    "reset-prefix-cache": ResetPrefixCache,
}

COLUMNS = ("worker", "state", "alive", "tp", "pp", "kv used", "running", "waiting")
COLUMNS += ("queued prefill",)
COLUMNS += ("prefill tok/s", "decode tok/s", "prefix hits")


class CtlError(Exception):
    """What the operator is told, on one line."""


def _connection_options(after_command: bool = False) -> argparse.ArgumentParser:
    """How ``lamina ctl`` reaches the bus (``NatsConfig``'s flags): accepted before the
    command or after it (where they override only what they name)."""
    options = argparse.ArgumentParser(add_help=False)
    add_arguments(options, NatsConfig)
    options.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for answers")
    if after_command:
        for action in options._actions:
            action.default = argparse.SUPPRESS
    return options


def _nats(args: argparse.Namespace) -> NatsConfig:
    """The bus to act on: as the flags and ``LAMINA_NATS_*`` say, else that of the
    ``lamina up`` running on this machine (``up_state``: its URL, CA and operator
    credential), else the local default."""
    up = up_state.running()
    operator = Path(up.credentials if up and up.credentials else lamina_home() / "nats")
    operator /= "operator.nk"
    defaults = {
        "nats_url": (up and up.nats_url) or DEFAULT_NATS_URL,
        "nats_credential": str(operator) if operator.exists() else None,
        "nats_tls_ca": (up and up.nats_tls_ca) or None,
    }
    return from_arguments(NatsConfig, args, defaults=defaults)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lamina ctl",
        description=__doc__.split("\n\n")[0],
        epilog="The NATS options default to the bus of the lamina up running here.",
        parents=[_connection_options()],
    )
    after = _connection_options(after_command=True)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="every worker as the scheduler sees it", parents=[after])
    for name in COMMANDS:
        sub = commands.add_parser(
            name, help=f"send {COMMANDS[name].__name__} to workers", parents=[after]
        )
        sub.add_argument("workers", nargs="*", help="worker ids")
        sub.add_argument("--all", action="store_true", help="every worker the scheduler knows")
        if name == "drain":
            sub.add_argument(
                "--move",
                action="store_true",
                help="hand running requests to other workers, with their KV, instead of "
                "finishing them",
            )
    args = parser.parse_args(argv)
    if args.command in COMMANDS and bool(args.workers) == args.all:
        parser.error(f"{args.command}: name the workers, or pass --all (not both)")
    return args


def shown_state(state: str, cordoned: bool, quarantined: bool = False) -> str:
    """A worker's state as ``lamina ctl`` shows it, in ``status`` and in a command's
    answer alike: a ready worker that takes no new requests is ``cordoned``."""
    if quarantined:
        return "quarantined"
    if cordoned and state == "ready":
        return "cordoned"
    return state


async def cluster_status(bus: Bus, timeout: float) -> ClusterStatus:
    try:
        return await bus.request(
            subjects.SCHED_STATUS, ClusterStatusRequest(), ClusterStatus, timeout=timeout
        )
    except (NoResponders, RequestTimeout) as exc:
        raise CtlError(f"no scheduler answered on {subjects.SCHED_STATUS} ({exc})") from exc


def status_table(status: ClusterStatus) -> str:
    rows = [COLUMNS]
    for view in status.workers:
        s = view.stats
        rows.append(
            (
                s.worker_id,
                shown_state(str(s.state), s.cordoned, view.quarantined),
                "yes" if view.alive else "no",
                str(s.tensor_parallel_size),
                str(s.pipeline_parallel_size),
                f"{s.kv_cache_usage:.0%}",
                str(s.num_running),
                str(s.num_waiting),
                str(s.num_queued_prefill_tokens),
                f"{s.prefill_tokens_per_s:.0f}",
                f"{s.decode_tokens_per_s:.0f}",
                f"{s.prefix_cache_hit_ratio:.0%}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    queue = f"scheduler {status.scheduler_id}: {status.queued} queued"
    queue += f" ({status.queued_tokens} prompt tokens)"
    return "\n".join([queue, *(line.rstrip() for line in lines)])


async def control(args: argparse.Namespace, bus: Bus) -> list[str]:
    """Send the command to each target; the lines to print. Raises :class:`CtlError` for
    targets that are unknown, and after sending when any failed."""
    known = [view.stats.worker_id for view in (await cluster_status(bus, args.timeout)).workers]
    targets = known if args.all else args.workers
    unknown = [w for w in targets if w not in known]
    if unknown:
        raise CtlError(
            f"unknown worker(s) {', '.join(unknown)}; known: {', '.join(known) or 'none'}"
        )
    lines, failed = [], False
    for worker_id in targets:
        try:
            ack = await bus.request(
                subjects.worker_control(worker_id),
                Drain(move=args.move) if args.command == "drain" else COMMANDS[args.command](),
                ControlAck,
                timeout=args.timeout,
            )
        except (NoResponders, RequestTimeout, BadReply) as exc:
            lines.append(f"{worker_id}: no answer ({exc})")
            failed = True
            continue
        verdict = "ok" if ack.ok else f"refused: {ack.message}"
        lines.append(f"{worker_id}: {verdict} (now {shown_state(str(ack.state), ack.cordoned)})")
        failed |= not ack.ok
    if failed:
        raise CtlError("\n".join(lines))
    return lines


async def run(args: argparse.Namespace) -> str:
    logging.getLogger("lamina.bus").setLevel(logging.ERROR)  # its retries are not news here
    try:
        nats = _nats(args)
        bus = await asyncio.wait_for(nats.connect("lamina-ctl"), args.timeout)
    except NotAdmitted as exc:
        raise CtlError(str(exc)) from exc
    except TimeoutError as exc:  # the client retries an unreachable server forever
        raise CtlError(f"cannot reach NATS at {nats.nats_url} within {args.timeout:g}s") from exc
    try:
        # One trace per invocation, from the operator to each worker and back, exported
        # as the services export theirs (OTEL_EXPORTER_OTLP_ENDPOINT, LAMINA_TRACE_FILE).
        with tracer.start_as_current_span(f"ctl {args.command}", kind=SpanKind.CLIENT):
            if args.command == "status":
                return status_table(await cluster_status(bus, args.timeout))
            return "\n".join(await control(args, bus))
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    setup_tracing("lamina-ctl")
    try:
        print(asyncio.run(run(args)))
    except CtlError as exc:
        print(f"lamina ctl: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()  # records and exports this invocation's trace
    return 0
