"""KV blocks from one worker to another: a direct TCP stream, authorised over the bus.

The scheduler decides a transfer (a request runs on worker B with prefix blocks worker A
holds) and authorises it with a one-time grant: it tells A, on ``worker.<A>.kv_send``,
which blocks may go under which token (:class:`KvGrant`), and puts the same grant id and
token in the request it sends B (``GenerateRequest.kv_source``). B connects to A's
transfer address (A's heartbeat's ``kv_address``) and names the grant; each side proves
it holds the token (HMAC-SHA256 over the other side's nonce, each under its own role, so
neither proof can be replayed to the other), and the grant is spent. A exports the
blocks (on its engine thread) and sends them sealed with AES-256-GCM under a key both
derive from the token and both nonces (fresh for every transfer): a header (layout,
hashes, each tensor's dtype and shape), each tensor's bytes in frames of at most 4 MiB,
then an empty last frame. Each
frame's nonce is its number and its cleartext prefix (length, last-frame flag) is
authenticated with it, so a frame altered, dropped, reordered or cut off fails to open.
B imports nothing unless every frame opens and the layout and the hashes (a leading run
of those it was told of) check: a block whose hash does not match is never served.

Only holders of the bus's credentials learn a token (the scheduler, A and B), so this
stream is no way around the closed bus, and its bytes are no more readable on the wire
than the bus's own under TLS. AES-GCM (AES-NI) also runs at over twice the HMAC-SHA256
that authenticated the bytes before it, so sealing costs less than the MAC alone did.

Why a TCP stream and not the bus: a block of a 7B model is about 2 MiB, larger than a
NATS server's default ``max_payload`` (1 MiB), and every byte through the bus crosses
the NATS server as well, a second copy and a second hop; ``benchmarks/kv_moves.py``
measures both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.services.engine_worker.engine.kv_tier import KvBlocks

log = logging.getLogger("lamina.worker.kv_transfer")

GRANT_TTL_S = 30.0
"""Seconds a grant waits for its receiver before it lapses."""
HANDSHAKE_TIMEOUT_S = 5.0
"""Most seconds each handshake message may take (the peer is not trusted yet)."""
GRANT_ARRIVAL_S = 2.0
"""Most seconds a sender waits for a grant its receiver names (the scheduler sends the
grant and the request at once, on different subjects: the receiver may come first)."""
_NONCE = 32
_MAX_HEADER = 1 << 20
_CHUNK = 4 << 20
"""Most plaintext bytes per sealed frame (a tensor goes in as many as it needs)."""
_TAG = 16
_PREFIX = struct.Struct("<IB")  # the sealed frame's length, and 1 on the last frame


class TransferFailed(Exception):
    """A transfer did not deliver verified blocks (the receiver recomputes instead)."""


@dataclass(frozen=True)
class _Header:
    layout: str
    parent_hash: int
    hashes: list[int]
    tensors: list[tuple[str, list[int]] | None]
    """Each layer's cache, then each layer's scales: (dtype, shape), or None (no scales)."""


_HEADER = msgspec.json.Decoder(_Header)


def _proof(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def _session_key(token: bytes, receiver_nonce: bytes, sender_nonce: bytes) -> AESGCM:
    """The transfer's AES-256-GCM key: the token's HMAC over both nonces, so that no two
    transfers share a key (and so no two frames a nonce) even were a token reused."""
    key = hmac.new(token, b"lamina kv stream" + receiver_nonce + sender_nonce, hashlib.sha256)
    return AESGCM(key.digest())


class _Sealer:
    """Numbered frames under one key: frame ``n`` is sealed with nonce ``n``."""

    def __init__(self, key: AESGCM) -> None:
        self._key = key
        self._frames = 0

    def _nonce(self) -> bytes:
        nonce = self._frames.to_bytes(12, "little")
        self._frames += 1
        return nonce

    def seal(self, plain: bytes | memoryview, last: bool = False) -> tuple[bytes, bytes]:
        """``(prefix, sealed)``: the frame as it goes on the wire."""
        prefix = _PREFIX.pack(len(plain) + _TAG, int(last))
        return prefix, self._key.encrypt(self._nonce(), plain, prefix)

    async def open(self, reader: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
        """The next frame's plaintext (at most ``limit`` bytes) and whether it is the
        last; raise :class:`TransferFailed` if it does not open."""
        prefix = await reader.readexactly(_PREFIX.size)
        length, last = _PREFIX.unpack(prefix)
        if not _TAG <= length <= limit + _TAG or last > 1:
            raise TransferFailed(f"a frame of {length} bytes (flag {last})")
        sealed = await reader.readexactly(length)
        try:
            return self._key.decrypt(self._nonce(), sealed, prefix), bool(last)
        except InvalidTag as exc:
            raise TransferFailed("a frame that does not open (altered, reordered or cut)") from exc


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferFailed(f"the sender named no torch dtype: {name!r}")
    return dtype


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


# ---------------------------------------------------------------------------- the sender
Export = Callable[[KvGrant], Awaitable[KvBlocks]]
"""Copy the leading run of the grant's block hashes that the engine holds to the host
(once it computed them, for a prefill leg)."""


class KvSender:
    """A worker's side that sends: the grants the scheduler gave it, and the listener its
    receivers connect to."""

    def __init__(self, export: Export, host: str) -> None:
        self._export = export
        self._host = host
        """The address it listens on, and that receivers are told."""
        self._grants: dict[str, tuple[KvGrant, float]] = {}
        self._arrived = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self.sent_blocks = 0

    @property
    def address(self) -> str:
        """``host:port`` receivers connect to (what the worker's heartbeat advertises)."""
        assert self._server is not None, "start first"
        port = self._server.sockets[0].getsockname()[1]
        return f"{self._host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, 0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    @property
    def pending(self) -> int:
        """Grants not yet spent nor lapsed."""
        self._lapse()
        return len(self._grants)

    async def grant(self, grant: KvGrant) -> None:
        """Take a grant from the scheduler (its receiver may already be waiting for it)."""
        self._lapse()
        async with self._arrived:
            self._grants[grant.grant_id] = (grant, time.monotonic() + GRANT_TTL_S)
            self._arrived.notify_all()

    def _lapse(self) -> None:
        now = time.monotonic()
        for grant_id in [g for g, (_, until) in self._grants.items() if until < now]:
            del self._grants[grant_id]

    async def _spend(self, grant_id: str) -> KvGrant | None:
        """The grant named ``grant_id``, waiting a moment for it; None if it never came."""

        def arrived() -> bool:
            return grant_id in self._grants

        async with self._arrived:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait_for(arrived), GRANT_ARRIVAL_S)
            entry = self._grants.get(grant_id)
        return None if entry is None else entry[0]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            agreed = await self._handshake(reader, writer)
            if agreed is None:
                return
            grant, key = agreed
            blocks = await self._export(grant)
            await _send(writer, blocks, _Sealer(key))
            self.sent_blocks += len(blocks.hashes)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, TransferFailed) as exc:
            log.warning("KV transfer to %s failed: %s", peer, exc or type(exc).__name__)
        except Exception:  # an export that failed: the receiver recomputes
            log.exception("KV transfer to %s failed", peer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[KvGrant, AESGCM] | None:
        """The grant the peer proves it holds (spent now) and the transfer's key, or None
        (it is dropped)."""
        hello = await _read(reader, 2 + 64 + _NONCE)
        (length,) = struct.unpack("<H", hello[:2])
        if length > 64:
            return None
        grant_id = hello[2 : 2 + length].decode(errors="replace")
        theirs = hello[2 + 64 :]
        grant = await self._spend(grant_id)
        if grant is None:
            log.warning("a KV receiver named grant %r, which this worker does not hold", grant_id)
            return None
        token = bytes.fromhex(grant.token)
        ours = secrets.token_bytes(_NONCE)
        writer.write(ours)
        await writer.drain()
        if not hmac.compare_digest(await _read(reader, 32), _proof(token, b"receiver", ours)):
            log.warning("a KV receiver did not prove grant %s's token", grant_id)
            return None
        self._grants.pop(grant_id, None)  # one use
        writer.write(_proof(token, b"sender", theirs))
        await writer.drain()
        return grant, _session_key(token, theirs, ours)


async def _read(reader: asyncio.StreamReader, n: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), HANDSHAKE_TIMEOUT_S)


async def _send(writer: asyncio.StreamWriter, blocks: KvBlocks, sealer: _Sealer) -> None:
    tensors = [*blocks.caches, *blocks.scales]
    header = msgspec.json.encode(
        _Header(
            blocks.layout,
            blocks.parent_hash,
            blocks.hashes,
            [
                None if t is None else (str(t.dtype).removeprefix("torch."), list(t.shape))
                for t in tensors
            ],
        )
    )
    writer.writelines(sealer.seal(header))
    for tensor in tensors:
        if tensor is not None:
            raw = _raw(tensor)
            for start in range(0, len(raw), _CHUNK):
                writer.writelines(sealer.seal(raw[start : start + _CHUNK]))
                await writer.drain()
    writer.writelines(sealer.seal(b"", last=True))
    await writer.drain()


# -------------------------------------------------------------------------- the receiver
async def fetch(source: KvSource, timeout_s: float) -> KvBlocks:
    """The blocks ``source`` names, from its worker, verified; raise
    :class:`TransferFailed` (or ``TimeoutError``) otherwise."""
    host, _, port = source.address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferFailed(f"not a transfer address: {source.address!r}")
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                return await _receive(reader, writer, source)
            finally:
                writer.close()
    except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
        raise TransferFailed(f"from {source.worker_id}: {exc or type(exc).__name__}") from exc


async def _receive(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: KvSource
) -> KvBlocks:
    token = bytes.fromhex(source.token)
    grant_id = source.grant_id.encode()
    ours = secrets.token_bytes(_NONCE)
    writer.write(struct.pack("<H", len(grant_id)) + grant_id.ljust(64, b"\0") + ours)
    theirs = await reader.readexactly(_NONCE)
    writer.write(_proof(token, b"receiver", theirs))
    await writer.drain()
    if not hmac.compare_digest(await reader.readexactly(32), _proof(token, b"sender", ours)):
        raise TransferFailed(f"{source.address} did not prove the grant's token")
    sealer = _Sealer(_session_key(token, ours, theirs))
    raw_header, last = await sealer.open(reader, _MAX_HEADER)
    try:
        header = _HEADER.decode(raw_header)
    except msgspec.DecodeError as exc:
        raise TransferFailed(f"an undecodable header: {exc}") from exc
    wanted = source.block_hashes
    if last or not header.hashes or header.hashes != wanted[: len(header.hashes)]:
        raise TransferFailed("the sender's blocks are not the ones asked for")
    tensors: list[torch.Tensor | None] = []
    for spec in header.tensors:
        if spec is None:
            tensors.append(None)
            continue
        dtype, shape = _dtype(spec[0]), spec[1]
        if len(shape) < 2 or shape[1] != len(header.hashes):  # (2, blocks, ...): theirs
            raise TransferFailed(f"a tensor of shape {shape} for {len(header.hashes)} blocks")
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = bytearray()
        while len(raw) < size:
            chunk, last = await sealer.open(reader, min(_CHUNK, size - len(raw)))
            if last or not chunk:
                raise TransferFailed("the blocks ended early")
            raw += chunk
        tensors.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape))
    _, last = await sealer.open(reader, 0)
    if not last:
        raise TransferFailed("more bytes than the header said")
    layers = len(tensors) // 2
    if len(tensors) != 2 * layers or any(t is None for t in tensors[:layers]):
        raise TransferFailed("the header's tensors are not a layout's caches and scales")
    return KvBlocks(
        header.layout,
        header.parent_hash,
        header.hashes,
        tensors[:layers],  # type: ignore[arg-type]
        tensors[layers:],
    )
