"""KV blocks between two engines over the transfer stream (``kv_transfer.py``): the
receiver gets exactly what the sender exported, and so gives the sender's tokens and
logprobs; a transfer without its grant, with another token, or of other blocks than
the receiver was told of delivers nothing, and the bytes cross the wire sealed."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest
import torch

from lamina.schemas.v1.kv_transfer import KvGrant, KvSource
from lamina.services.engine_worker import kv_transfer
from lamina.services.engine_worker.kv_transfer import KvSender, TransferFailed
from tests.engine.helpers import make_engine
from tests.engine.test_kv_tier import FILLERS, PREFIX, QUESTION, _engine, _hashes, _run


def _grant(hashes: list[int]) -> KvGrant:
    return KvGrant(
        grant_id=secrets.token_hex(16),
        token=secrets.token_hex(32),
        receiver="b",
        block_hashes=hashes,
    )


def _source(sender: KvSender, grant: KvGrant, **changes) -> KvSource:
    fields = dict(
        worker_id="a",
        address=sender.address,
        grant_id=grant.grant_id,
        token=grant.token,
        block_hashes=grant.block_hashes,
    )
    return KvSource(**(fields | changes))


@contextlib.asynccontextmanager
async def _serving(engine):
    """A transfer listener that sends ``engine``'s blocks."""

    async def export(grant):
        return engine.export_blocks(grant.block_hashes)

    sender = KvSender(export, "127.0.0.1")
    await sender.start()
    try:
        yield sender
    finally:
        await sender.close()


async def _transfer(engine, grant: KvGrant, source_of):
    """One fetch of ``grant`` from ``engine``, the receiver told ``source_of(sender,
    grant)``; the blocks and the sender."""
    async with _serving(engine) as sender:
        await sender.grant(grant)
        return await kv_transfer.fetch(source_of(sender, grant), 10.0), sender


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_blocks_fetched_give_the_senders_tokens_and_logprobs(stories, kv_cache_dtype):
    sender = make_engine(stories, num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype)
    want = _run(sender, {"p": PREFIX, "q": QUESTION})["q"]
    grant = _grant(_hashes(sender, QUESTION))
    blocks, server = asyncio.run(_transfer(sender, grant, _source))
    assert blocks.hashes == grant.block_hashes[:4] and server.sent_blocks == 4
    assert server.pending == 0  # spent: one use

    receiver = make_engine(stories, num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype)
    assert receiver.import_blocks(blocks) == 4
    assert _run(receiver, {"q": QUESTION})["q"] == want


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_blocks_in_the_senders_lower_tier_are_sent_too(stories, tmp_path, kv_cache_dtype, tier):
    """The prefix was evicted from the sender's device to a lower tier: the export reads
    the tier, and the receiver gets the tokens and logprobs the sender gives."""
    disk = dict(kv_offload_bytes=0, kv_offload_disk_bytes=64 << 20, kv_offload_dir=str(tmp_path))
    sender = _engine(stories, kv_cache_dtype=kv_cache_dtype, **(disk if tier == "disk" else {}))
    want = _run(sender, {"p": PREFIX, "q": QUESTION})["q"]
    _run(sender, FILLERS)
    hashes = _hashes(sender, QUESTION)
    assert [getattr(sender.blocks.holder(h), "medium", None) for h in hashes[:4]] == [tier] * 4
    blocks, _ = asyncio.run(_transfer(sender, _grant(hashes), _source))
    assert blocks.hashes == hashes[:4]
    receiver = make_engine(stories, num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype)
    assert receiver.import_blocks(blocks) == 4
    assert _run(receiver, {"q": QUESTION})["q"] == want


def test_a_grant_is_spent_by_its_first_transfer(stories):
    sender = make_engine(stories, num_kv_blocks=16)
    _run(sender, {"p": PREFIX})
    grant = _grant(_hashes(sender, PREFIX))

    async def twice():
        async with _serving(sender) as server:
            await server.grant(grant)
            first = await kv_transfer.fetch(_source(server, grant), 10)
            with pytest.raises(TransferFailed):
                await kv_transfer.fetch(_source(server, grant), 10)
            return first

    assert len(asyncio.run(twice()).hashes) == 4


@pytest.mark.parametrize(
    "wrong",
    [
        {"token": "0" * 64},  # another token: the sender's proof check fails
        {"grant_id": "f" * 32},  # a grant the sender never had
    ],
)
def test_a_receiver_without_the_grant_gets_nothing(stories, wrong):
    sender = make_engine(stories, num_kv_blocks=16)
    _run(sender, {"p": PREFIX})
    grant = _grant(_hashes(sender, PREFIX))
    with pytest.raises(TransferFailed):
        asyncio.run(_transfer(sender, grant, lambda s, g: _source(s, g, **wrong)))


def test_blocks_other_than_those_the_receiver_was_told_of_are_refused(stories):
    sender = make_engine(stories, num_kv_blocks=16)
    _run(sender, {"p": PREFIX})
    grant = _grant(_hashes(sender, PREFIX))
    told = [h + 1 for h in grant.block_hashes]
    with pytest.raises(TransferFailed, match="not the ones asked for"):
        asyncio.run(_transfer(sender, grant, lambda s, g: _source(s, g, block_hashes=told)))


def _relayed(sender, grant, change):
    """Fetch ``grant`` from ``sender`` through a proxy that hands every chunk the sender
    sends to ``change(offset, chunk)`` and forwards what it returns (None: it hangs up);
    the blocks, or what the fetch raised."""

    async def pipe(reader, writer, alter):
        seen = 0
        while chunk := await reader.read(65536):
            forward = alter(seen, chunk)
            seen += len(chunk)
            if forward is None:
                break
            writer.write(bytes(forward))
            await writer.drain()
        writer.close()

    async def main():
        async with _serving(sender) as server:
            host, port = server.address.rsplit(":", 1)

            async def proxy(client_reader, client_writer):
                reader, writer = await asyncio.open_connection(host, int(port))
                await asyncio.gather(
                    pipe(client_reader, writer, lambda _, chunk: chunk),
                    pipe(reader, client_writer, change),
                )

            relay = await asyncio.start_server(proxy, "127.0.0.1", 0)
            relayed = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
            try:
                await server.grant(grant)
                return await kv_transfer.fetch(_source(server, grant, address=relayed), 10)
            except TransferFailed as exc:
                return exc
            finally:
                relay.close()

    return asyncio.run(main())


def test_blocks_altered_or_cut_on_the_way_are_refused(stories):
    """A proxy between the two flips one byte of the blocks' data (after the handshake
    and the header), or hangs up before the last frame: the receiver keeps nothing."""
    sender = make_engine(stories, num_kv_blocks=16)
    _run(sender, {"p": PREFIX})
    grant = _grant(_hashes(sender, PREFIX))

    def flip(offset, chunk):
        if offset <= 4096 < offset + len(chunk):
            chunk = bytearray(chunk)
            chunk[4096 - offset] ^= 0x01
        return chunk

    failed = _relayed(sender, grant, flip)
    assert isinstance(failed, TransferFailed) and "does not open" in str(failed)
    grant = _grant(_hashes(sender, PREFIX))
    cut = _relayed(sender, grant, lambda offset, chunk: chunk if offset < 8192 else None)
    assert isinstance(cut, TransferFailed)


def test_the_blocks_cross_the_wire_sealed(stories):
    """What the sender puts on the wire holds none of the blocks' bytes in the clear, nor
    their hashes; the receiver gets them whole."""
    sender = make_engine(stories, num_kv_blocks=16)
    _run(sender, {"p": PREFIX})
    grant = _grant(_hashes(sender, PREFIX))
    wire = bytearray()
    blocks = _relayed(sender, grant, lambda _, chunk: (wire.extend(chunk), chunk)[1])
    assert not isinstance(blocks, Exception) and blocks.hashes == grant.block_hashes
    cache = blocks.caches[0].contiguous().view(torch.uint8).numpy().tobytes()
    assert len(wire) > len(cache)
    for start in range(0, len(cache) - 32, len(cache) // 8):
        assert cache[start : start + 32] not in wire
    assert str(grant.block_hashes[0]).encode() not in wire
