"""The step channel of a parallel engine's remote ranks (``remote_ranks.py``): real
sockets on loopback. Only a peer that proves the rendezvous's key, and names a rank the
driver waits for, gets through; anything else is dropped and the listener goes on. And
the rendezvous on the wire (``wire.py``)."""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import msgspec
import pytest

from lamina.libs.bus import decoder, encode
from lamina.schemas.v1.ranks import RankRendezvous
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.engine import remote_ranks
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.remote_ranks import (
    Rendezvous,
    StepListener,
    checkpoint_digest,
    connect,
    interface_of,
)


@pytest.fixture(autouse=True)
def quick_handshakes(monkeypatch):
    monkeypatch.setattr(remote_ranks, "HANDSHAKE_TIMEOUT_S", 0.5)


def _later(fn, *args):
    """``fn(*args)`` on a thread; returns (the thread, its result or error)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as exc:  # the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_ranks_that_hold_the_key_join_and_hostile_peers_are_dropped():
    key = secrets.token_bytes(32)
    listener = StepListener("127.0.0.1", key)
    address = (listener.host, listener.port)
    accepting, accepted = _later(listener.accept, {2, 3}, time.monotonic() + 30, lambda: None)
    hostile = []
    # A wrong key; garbage; silence (dropped after the handshake's timeout); a right key
    # naming a rank nobody waits for.
    _, wrong = _later(connect, *address, b"x" * 32, 2)
    garbage = socket.create_connection(address)
    garbage.sendall(struct.pack("!i", 5) + b"hello")
    silent = socket.create_connection(address)
    hostile += [garbage, silent]
    _, stranger = _later(connect, *address, key, 7)
    time.sleep(1.5)
    _, two = _later(connect, *address, key, 2)
    _, three = _later(connect, *address, key, 3)
    accepting.join(30)
    joined = accepted["value"]
    assert sorted(joined) == [2, 3]
    assert isinstance(wrong.get("error"), ConnectionError)
    # Each joined rank's connection carries what the driver sends.
    for rank, out in ((2, two), (3, three)):
        joined[rank].send_bytes(b"step")
        assert out["value"].recv_bytes() == b"step"
        out["value"].close()
    assert _closed(stranger["value"])  # it held the key, but named no rank waited for
    for sock in hostile:
        sock.close()


def _closed(conn) -> bool:
    try:
        conn.recv_bytes()
    except (EOFError, OSError):
        return True
    return False


def test_a_rank_that_never_joins_times_the_listener_out_and_it_checks_meanwhile():
    listener = StepListener("127.0.0.1", secrets.token_bytes(32))
    checks = []
    with pytest.raises(TimeoutError, match="rank"):
        listener.accept({1}, time.monotonic() + 2.5, lambda: checks.append(1))
    assert checks  # a local rank's death would have been seen meanwhile


def test_a_driver_without_the_key_is_refused_by_the_rank():
    right, wrong = secrets.token_bytes(32), secrets.token_bytes(32)
    listener = StepListener("127.0.0.1", wrong)
    _later(listener.accept, {1}, time.monotonic() + 5, lambda: None)
    with pytest.raises(ConnectionError):
        connect(listener.host, listener.port, right, 1)


def test_the_loopback_interface_holds_the_loopback_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: nobody's


def test_a_checkpoint_digest_tells_apart_weights_that_share_their_shapes(tmp_path):
    for name, fill in (("a", b"\1"), ("b", b"\2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(fill * 4096)
    a, b = checkpoint_digest(tmp_path / "a"), checkpoint_digest(tmp_path / "b")
    assert a != b and a == checkpoint_digest(tmp_path / "a")


def test_a_rendezvous_crosses_the_wire_and_one_that_makes_none_is_refused():
    config = EngineConfig(model=Path("/m"), pipeline_parallel_size=2, remote_pipeline_stages=1)
    sent = Rendezvous("tcp://10.0.0.1:4100", "10.0.0.1", 4101, b"k" * 32, config, "d1", 30.0)
    received = decoder(RankRendezvous).decode(encode(wire.rendezvous(sent, "w-0", "inc")))
    assert wire.rendezvous_from(received) == sent
    for bad in (
        {"key": "not hex"},
        {"key": ""},
        {"port": 0},
        {"store": "file:///etc/passwd"},
        {"engine": {"tensor_parallel_size": "two"}},
        {"engine": {"remote_pipeline_stages": 3}},  # more than its stages
    ):
        with pytest.raises(ValueError):
            wire.rendezvous_from(msgspec.structs.replace(received, **bad))
