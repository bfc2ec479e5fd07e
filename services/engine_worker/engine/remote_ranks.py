"""A parallel engine's ranks on other hosts: its last pipeline stages, joining the worker
over the network.

A worker with ``remote_pipeline_stages`` R runs its first P - R stages as its own
processes (``rank_group.py``) and waits for the ranks of the last R to join from other
hosts, each stage's from a stage host (``lamina node --pipeline-stage <worker
id>:<stage>``: ``services/engine_worker/stage_host.py``, which calls
``stage_ranks.start_stage``).
What a stage host needs is a :class:`Rendezvous`, which the worker answers on the bus
(``worker.<id>.ranks``: only the worker's own identity may ask, so a stage host connects
as the worker it serves). Nothing is configured by hand:

* the ``torch.distributed`` store's address (rank 0 hosts it, on the worker's
  ``distributed_address``);
* the step channel: a TCP listener of the driver (:class:`StepListener`). Each remote
  rank connects, proves it holds the rendezvous's key and learns that the driver does
  (:func:`handshake`), and names its rank; from then on it receives each step's input
  as a local rank does on its pipe, and its end-of-file is the rank's exit;
* the driver's :class:`EngineConfig`, which the stage host runs with its own model path
  and device once it has checked that its checkpoint is the driver's
  (:func:`checkpoint_digest`).

gloo picks its network interface by the host name, which on a host with several (or a
test host in a network namespace) can resolve to the wrong one; each side names the one
that holds its address toward the other (``GLOO_SOCKET_IFNAME``, :func:`use_interface_toward`).

Not encrypted: the step channel is authenticated but carries token ids in the clear, and
the collectives (gloo or NCCL: the hidden states between stages) are neither
authenticated nor encrypted, as in vLLM and SGLang. Stages belong on a network the
operator trusts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from lamina.services.engine_worker.engine.config import EngineConfig

log = logging.getLogger("lamina.worker.ranks")

HANDSHAKE_TIMEOUT_S = 10.0
"""Most seconds a peer of the step channel may take over each message of the handshake
(a connection that stalls is dropped, and the listener takes the next)."""
_NONCE = 32
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Rendezvous:
    """How a worker's ranks on other hosts join it (published on the bus)."""

    store: str
    """``tcp://host:port``: the ``torch.distributed`` store rank 0 hosts."""
    host: str
    port: int
    """Where the driver's step channel listens."""
    key: bytes
    """This rendezvous's secret: a remote rank proves it holds it (a new one per group)."""
    config: EngineConfig
    """The driver's engine configuration."""
    digest: str
    """The driver's :func:`checkpoint_digest`."""
    timeout_s: float
    """Most seconds a collective of the group waits (the worker's, derived from its
    stall timeout: every rank fails a hung one alike)."""


# ------------------------------------------------------------------------- the handshake
def _proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _receive(conn: Connection) -> bytes:
    """One message of the handshake (a bounded one: the peer is not trusted yet)."""
    if not conn.poll(HANDSHAKE_TIMEOUT_S):
        raise ConnectionError(f"no answer within {HANDSHAKE_TIMEOUT_S:g}s")
    try:
        return conn.recv_bytes(2 * _NONCE + 64)
    except (OSError, EOFError) as exc:  # too long, cut short, or a stalled read (SO_RCVTIMEO)
        raise ConnectionError(f"a broken handshake ({exc or type(exc).__name__})") from exc


def handshake(conn: Connection, key: bytes, driver: bool) -> None:
    """Prove ``key`` to the peer and check the peer's proof; raises ConnectionError.

    The driver sends a nonce; the rank answers with its proof of it and a nonce of its
    own; the driver checks the proof before it answers with its own. The two proofs are
    of different roles, so a peer cannot get one side's answer to replay to it."""
    if driver:
        ours = secrets.token_bytes(_NONCE)
        conn.send_bytes(ours)
        answer = _receive(conn)
        theirs, proof = answer[:_NONCE], answer[_NONCE:]
        if len(theirs) != _NONCE or not hmac.compare_digest(proof, _proof(key, b"rank", ours)):
            raise ConnectionError("the peer does not hold this rendezvous's key")
        conn.send_bytes(_proof(key, b"driver", theirs))
        return
    challenge = _receive(conn)
    ours = secrets.token_bytes(_NONCE)
    conn.send_bytes(ours + _proof(key, b"rank", challenge))
    if not hmac.compare_digest(_receive(conn), _proof(key, b"driver", ours)):
        raise ConnectionError("the step channel's listener does not hold the rendezvous's key")


def _connection(sock: socket.socket) -> Connection:
    """``sock`` as a ``multiprocessing`` connection whose reads give up after
    :data:`HANDSHAKE_TIMEOUT_S` (until :func:`_trusted` lifts that)."""
    sock.setblocking(True)
    _read_timeout(sock, HANDSHAKE_TIMEOUT_S)
    return Connection(sock.detach())


def _read_timeout(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)


def _trusted(conn: Connection) -> Connection:
    """``conn`` after the handshake: reads wait as long as the group does (a rank waits
    for steps while the worker is idle)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        _read_timeout(sock, 0)
    return conn


class StepListener:
    """The driver's end of the step channel: accepts the remote ranks' connections."""

    def __init__(self, host: str, key: bytes) -> None:
        self.key = key
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]

    def accept(
        self, ranks: set[int], deadline: float, check: Callable[[], None]
    ) -> dict[int, Connection]:
        """A trusted connection from each rank of ``ranks``, each of which names itself
        in its first message (``("joining", rank)``). Each connection shakes hands on a
        thread of its own, so a peer that stalls delays no other; one that fails the
        handshake or names no rank it should is dropped (logged). ``check()`` runs about
        once a second meanwhile (it raises to give up: a local rank that died). Raises
        TimeoutError at ``deadline``."""
        joined: dict[int, Connection] = {}
        arrived: queue.Queue[tuple[Connection, object]] = queue.Queue()
        self._sock.settimeout(0.2)
        checked = time.monotonic()
        try:
            while ranks - joined.keys():
                if time.monotonic() >= deadline:
                    missing = ", ".join(map(str, sorted(ranks - joined.keys())))
                    raise TimeoutError(f"rank(s) {missing} did not join")
                with contextlib.suppress(TimeoutError):
                    sock, peer = self._sock.accept()
                    threading.Thread(
                        target=self._shake, args=(sock, peer, arrived), daemon=True
                    ).start()
                while not arrived.empty():
                    conn, rank = arrived.get()
                    if rank in ranks and rank not in joined:
                        joined[rank] = _trusted(conn)
                    else:
                        log.warning("step channel: dropped a peer that said it is rank %r", rank)
                        conn.close()
                if time.monotonic() - checked >= 1.0:
                    check()
                    checked = time.monotonic()
        except BaseException:
            for conn in joined.values():
                conn.close()
            raise
        finally:
            self.close()
        return joined

    def _shake(self, sock: socket.socket, peer: object, arrived: queue.Queue) -> None:
        """One connection's handshake and first message; queued if it holds the key."""
        conn = _connection(sock)
        try:
            handshake(conn, self.key, driver=True)
            kind, rank = conn.recv()  # pickled, and trusted: it holds the key
            if kind != "joining":
                raise ConnectionError(f"it said {kind!r}")
        except (ConnectionError, EOFError, OSError, ValueError, TypeError) as exc:
            log.warning("step channel: dropped a connection from %s: %s", peer, exc)
            conn.close()
            return
        arrived.put((conn, rank))

    def close(self) -> None:
        self._sock.close()


def connect(host: str, port: int, key: bytes, rank: int) -> Connection:
    """A remote rank's end of the step channel, once both sides proved ``key``; it has
    said ``("joining", rank)``."""
    sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
    conn = _connection(sock)
    try:
        handshake(conn, key, driver=False)
        conn.send(("joining", rank))
    except BaseException:
        conn.close()
        raise
    return _trusted(conn)


# --------------------------------------------------------------------------- interfaces
def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` (None: no interface does)."""
    address = socket.gethostbyname(address)
    for _, name in socket.if_nameindex():
        request = struct.pack("256s", name.encode()[:15])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
        if socket.inet_ntoa(reply[20:24]) == address:
            return name
    return None


def use_interface_toward(peer: str) -> None:
    """Make this process's gloo (and the ranks it starts after) use the interface of its
    address on the route to ``peer`` (``GLOO_SOCKET_IFNAME``); a loopback peer changes
    nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(peer), 9))  # no packet: it picks the route
        ours = sock.getsockname()[0]
    name = interface_of(ours)
    if name is not None and not ours.startswith("127."):
        os.environ["GLOO_SOCKET_IFNAME"] = name


# --------------------------------------------------------------------------- checkpoints
_SAMPLE = 1 << 20


def checkpoint_digest(path: Path) -> str:
    """What identifies a checkpoint across hosts: its ``config.json``, and each weight
    file's name, size, header and first and last MiB (the tensors' names, shapes and
    offsets, and values enough to tell two initialisations apart), hashed."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}\0{size}\0".encode())
        with open(weights, "rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


__all__ = [
    "Rendezvous",
    "StepListener",
    "checkpoint_digest",
    "connect",
    "handshake",
    "interface_of",
    "use_interface_toward",
]
