"""The floor under a gateway's cost per streamed token: a process that takes each bus
message (one a step, as a worker's ``StreamBatch``) and writes one HTTP chunk to each of
its streams' connections, and does nothing else: plain nats-py on uvloop, as the
gateway's loop is. ``data_path.py --floor`` runs it and measures its CPU per chunk.

    python bus_relay.py NATS_URL PORT STREAMS
"""

from __future__ import annotations

import asyncio
import sys

import nats
import uvloop
from nats.aio.msg import Msg

SUBJECT = "floor.tokens"
TOKEN = 24
"""Bytes of one stream's share of a message (the chunk it writes), about a token's chunk's
JSON: the relay relays bytes, it builds nothing."""


async def relay(url: str, port: int, streams: int) -> None:
    """Connect ``streams`` times to ``port``, then write each message's ``TOKEN``-byte
    slices, one to each connection, as HTTP chunks."""
    writers = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in range(streams)]
    client = await nats.connect(url)

    async def forward(msg: Msg) -> None:
        for at, writer in enumerate(writers):
            data = msg.data[at * TOKEN : (at + 1) * TOKEN]
            writer.write(b"%x\r\ndata: %b\n\n\r\n" % (len(data) + 8, data))

    await client.subscribe(SUBJECT, cb=forward)
    await client.flush()
    print("subscribed", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(relay(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
