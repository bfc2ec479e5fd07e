"""What a running ``lamina up`` (or ``lamina node``) tells the other commands on its
machine: where its bus is, and which process serves it.

``lamina up`` writes ``LAMINA_HOME/up.json`` once its stack is up and removes it when it
stops; ``lamina ctl`` connects to the bus it names (no ``--nats-url`` to copy from the
banner), and ``lamina creds add`` has its NATS server re-read the credential store, so a
new identity is admitted at once. A file whose ``lamina up`` is gone is ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from lamina.libs.config import lamina_home


@dataclass(frozen=True)
class UpState:
    """A running stack, as the machine's other commands need it."""

    pid: int
    """The ``lamina up`` process."""
    nats_url: str
    nats_tls_ca: str = ""
    nats_pid: int = 0
    """Its embedded ``nats-server`` (0: it uses one it did not start)."""
    credentials: str = ""
    """Its credential store (empty: an open bus)."""


def path() -> Path:
    return lamina_home() / "up.json"


def record(state: UpState) -> None:
    """Say that ``state``'s stack is up (replacing what another one said)."""
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(asdict(state)))
    partial.replace(target)  # never half a file to a reader


def forget(pid: int) -> None:
    """Remove the record, if it is still ``pid``'s."""
    found = running()
    if found is not None and found.pid == pid:
        path().unlink(missing_ok=True)


def running() -> UpState | None:
    """The stack recorded here, if its ``lamina up`` is still alive."""
    try:
        state = UpState(**json.loads(path().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return state if _alive(state.pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's, and alive
        return True
    return True
