"""What a streamed token costs outside the engine, per hop (issue 44).

A stack (``Stack``: embedded nats-server, scheduler, telemetry, gateway) whose one
worker runs an engine that costs nothing (``free_worker.py``: the real worker shell and
engine bookkeeping, a forward pass that is one ``--step-ms`` sleep), and streaming
clients on the gateway's OpenAI API: at each of ``--concurrency`` levels, that many
clients each stream completions of ``--tokens`` tokens back to back for ``--seconds``.
Each process's CPU time over the window (``/proc/<pid>/stat``, its children included),
less what it spent over an idle window as long just before (heartbeats, stats, the
``/health`` probe: ~0.5 probe a token at one stream would otherwise count), divided
by the tokens the clients received: CPU microseconds per streamed token for the worker,
nats-server, the gateway, the rest (scheduler and telemetry) and the client (this
process: httpx, and a ``/health`` probe every 20 ms whose p99 the table shows too).

With ``--floor``, each level also runs ``bus_relay.py`` on the same bus: a process that
takes one message a step and writes a chunk from it to each stream's connection and does
nothing else, its CPU per chunk the least a gateway's loop can cost a token here.

With ``--profile``, one more window at the last level runs under ``py-spy record``
(``pip install .[profile]``; only threads holding the GIL: CPU, not waits) on the
gateway and the worker, and prints where their samples land: each one's hottest
functions by own samples, and Lamina's by samples under them.

Not a test: run it by hand on an otherwise idle machine::

    .venv/bin/python -u benchmarks/data_path.py
    .venv/bin/python -u benchmarks/data_path.py --stream-interval 4 --gateways 2
    .venv/bin/python -u benchmarks/data_path.py --floor
    .venv/bin/python -u benchmarks/data_path.py --lean --step-ms 2 --concurrency 16 32 64 128
    .venv/bin/python -u benchmarks/data_path.py --concurrency 1 32 256 --step-ms 10 --profile

``--lean`` clients read each response as raw bytes, for the most tokens/s the stack
sustains before ``/health``'s p99 passes 50 ms (printed last); with httpx the client
itself fills this machine's two cores near 3,000 tokens/s.

One gateway's own ceiling needs a core the rest of the stack does not take: with
``--gateway-core`` the gateway runs on the last CPU alone and every other process (the
services, nats-server, the clients) on the others, and ``--null-engine`` leaves out the
engine's bookkeeping (``free_worker.NullEngine``: the worker shell alone), which at
these rates would take most of a core itself::

    .venv/bin/python -u benchmarks/data_path.py --lean --null-engine --gateway-core \
        --step-ms 2 --concurrency 128 256 384
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import httpx
import uvloop
from bus_relay import SUBJECT, TOKEN
from nats import connect as bus_connect
from timing import pct, wait_for_workers

from lamina.libs.nats_server import NatsServer, free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.launcher import NATS_PROCS, Stack

HERE = Path(__file__).resolve().parent
HEALTHY_P99_MS = 50
"""The gateway's ``/health`` p99 up to which a level counts as sustained (issue 44)."""
TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants, and of its children that ended
    (``cutime``/``cstime``)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        if pid == root:
            ticks += int(fields[13]) + int(fields[14])  # ended children's
        times[pid] = ticks / TICK
    total, family = 0.0, {root}
    for pid in sorted(parents):  # parents before children: pids grow (no wrap here)
        if pid in family or parents[pid] in family:
            family.add(pid)
            total += times.get(pid, 0.0)
    return total


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """Each named process tree's CPU seconds, and this process's (the client)."""
    seen = {name: tree_cpu(pid) for name, pid in pids.items()}
    seen["client"] = time.process_time()
    return seen


async def load(
    base_url: str, clients: int, tokens: int, seconds: float, lean: bool = False
) -> tuple[int, list, int, list]:
    """``clients`` streams of ``tokens``-token completions, back to back, for
    ``seconds``; the tokens received, the ``/health`` latencies meanwhile (s), the
    requests sent again because their kept-alive connection was closed under them (a
    client whose loop lags more than the server's keep-alive timeout between two
    requests: the OpenAI SDK retries those too). ``lean``: each stream read as bytes
    (:func:`lean_stream`) instead of by httpx line by line; and each httpx stream's time
    to its first token (s; none for ``lean``)."""
    stop = time.perf_counter() + seconds
    received = retried = 0
    health: list[float] = []
    first_tokens: list[float] = []
    body = {
        "prompt": [5, 6, 7, 8, 9, 10, 11, 12],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def one() -> None:
            nonlocal received, retried
            while time.perf_counter() < stop:
                started, first = time.perf_counter(), True
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        async for line in response.aiter_lines():
                            if first and line.startswith("data: {"):
                                first_tokens.append(time.perf_counter() - started)
                                first = False
                            if line.startswith('data: {"id"') and '"usage":{' in line:
                                start = line.index('"completion_tokens":') + 20
                                received += int(line[start : line.index(",", start)])
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    retried += 1

        async def one_lean() -> None:
            nonlocal received, retried
            got, again = await lean_stream(base_url, body, stop)
            received, retried = received + got, retried + again

        async def probe() -> None:
            while time.perf_counter() < stop:
                started = time.perf_counter()
                (await client.get("/health")).raise_for_status()
                health.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)

        streams = (one_lean() if lean else one() for _ in range(clients))
        await asyncio.gather(probe(), *streams)
    return received, health, retried, first_tokens


CHUNKED_END = b"\r\n0\r\n\r\n"
"""How a chunked HTTP response ends: its last chunk's line end, then the empty chunk."""


async def lean_stream(base_url: str, body: dict, stop: float) -> tuple[int, int]:
    """Streamed completions of ``body`` back to back on one kept-alive connection until
    ``stop``, each read as raw bytes to the end of its chunked response, its tokens taken
    from the usage chunk at the end: a client whose CPU per token is a fraction of
    httpx's (which splits and decodes every SSE line), so that the stack, not the
    client, is what fills the machine. The tokens received and the requests lost to a
    closed connection."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    received = retried = 0
    writer: asyncio.StreamWriter | None = None
    while time.perf_counter() < stop:
        if writer is None:
            reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        head, tail = b"", b""
        while not tail.endswith(CHUNKED_END):
            data = await reader.read(1 << 16)
            if not data:  # the server closed the kept-alive connection
                writer.close()
                writer, retried = None, retried + 1
                break
            if not head:
                head = data
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the gateway answered {head[:200]!r}")
            tail = (tail + data)[-4096:]
        else:
            at = tail.rfind(b'"completion_tokens":') + 20
            received += int(tail[at : tail.index(b",", at)])
    if writer is not None:
        writer.close()
    return received, retried


def pin_gateways(pids: dict[str, int], cpu: int) -> None:
    """Every thread of each gateway process onto ``cpu`` (threads it starts later
    inherit it)."""
    for name, pid in pids.items():
        if name.startswith("gateway"):
            for thread in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(thread), {cpu})


def published(monitor: str) -> Counter[str]:
    """Messages each connection has published so far (nats-server's ``/connz``), by the
    connection's name (``Bus.connect``'s: the service)."""
    with urllib.request.urlopen(f"{monitor}/connz?limit=1024", timeout=5) as response:
        connections = json.load(response)["connections"]
    sent: Counter[str] = Counter()
    for connection in connections:  # several gateways connect under one name
        sent[connection.get("name", "?")] += connection["in_msgs"]
    return sent


def measure(
    stack: Stack, pids: dict[str, int], monitor: str, args, clients: int
) -> tuple[dict[str, float], Counter[str]]:
    """One level: the idle window (heartbeats, stats, and the ``/health`` probe), then
    the loaded one; and the messages each service published during the loaded one."""
    # The lean clients run on uvloop, as the gateway does: the client shares its cores with
    # the rest of the stack, so the less it costs a token, the further the stack is driven.
    run = uvloop.run if args.lean else asyncio.run
    before = cpu_of(pids)
    run(load(stack.base_url, 0, args.tokens, args.seconds))  # the probe alone
    idle = {name: value - before[name] for name, value in cpu_of(pids).items()}
    before, sent = cpu_of(pids), published(monitor)
    started = time.perf_counter()
    tokens, health, retried, first_tokens = run(
        load(stack.base_url, clients, args.tokens, args.seconds, args.lean)
    )
    elapsed = time.perf_counter() - started
    after, messages = cpu_of(pids), published(monitor) - sent
    row = {
        name: (after[name] - before[name] - idle[name] * elapsed / args.seconds) / tokens * 1e6
        for name in after
    }
    row["tokens_per_s"] = tokens / elapsed
    row["health_p99_ms"] = pct(health, 0.99) * 1e3
    row["ttft_ms"] = [pct(first_tokens, q) * 1e3 if first_tokens else 0.0 for q in (0.5, 0.9)]
    row["retried"] = retried
    row["messages"] = messages.total() / tokens
    return row, messages


async def floor(nats_url: str, streams: int, step_ms: float, seconds: float) -> float:
    """CPU microseconds per chunk of ``bus_relay.py`` (a bus message in, a chunk out to
    each stream, nothing else) with ``streams`` streams and a message every
    ``step_ms``: the least a gateway's loop can cost a token on this machine."""
    chunks = 0

    async def reading(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        nonlocal chunks
        while data := await reader.read(1 << 16):
            chunks += data.count(b"data: ")

    server = await asyncio.start_server(reading, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "bus_relay.py"), nats_url, str(port), str(streams),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert relay.stdout is not None
    await relay.stdout.readline()  # subscribed
    client = await bus_connect(nats_url)
    payload = bytes(TOKEN * streams)
    try:
        for window in (1.0, seconds):  # a second's warm-up, then the measured window
            cpu, counted, n = tree_cpu(relay.pid), chunks, 0
            started = time.perf_counter()
            while time.perf_counter() - started < window:
                n += 1
                await client.publish(SUBJECT, payload)
                await asyncio.sleep(max(0.0, started + n * step_ms / 1e3 - time.perf_counter()))
            await client.flush()
            await asyncio.sleep(0.2)  # the last chunks arrive
        return (tree_cpu(relay.pid) - cpu) / (chunks - counted) * 1e6
    finally:
        await client.close()
        relay.kill()
        await relay.wait()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--seconds", type=float, default=10.0, help="each level's window")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the free engine's step")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the worker's: tokens a stream sends at once"
    )
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes on the port")
    parser.add_argument(
        "--lean", action="store_true", help="clients that read raw bytes (for the ceiling)"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy, at the last level")
    parser.add_argument("--top", type=int, default=12, help="--profile: functions shown")
    parser.add_argument("--log-dir", default="", help="keep the services' logs here")
    parser.add_argument(
        "--floor", action="store_true", help="at each level, bus_relay.py's CPU per token too"
    )
    parser.add_argument(
        "--nats-procs", type=int, default=NATS_PROCS, help="nats-server's GOMAXPROCS (0: Go's)"
    )
    parser.add_argument(
        "--null-engine", action="store_true", help="the worker shell without engine bookkeeping"
    )
    parser.add_argument(
        "--gateway-core", action="store_true", help="the gateway alone on the last CPU"
    )
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.gateway_core:  # this process and all it starts on the others
        if len(cpus) < 2 or args.gateways != 1:
            parser.error("--gateway-core: one gateway, on a machine of two CPUs or more")
        os.sched_setaffinity(0, cpus[:-1])
    model = ensure_default_model(args.preset)
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
    monitor_port = free_port()
    monitor = f"http://127.0.0.1:{monitor_port}"
    bus = NatsServer(monitor_port=monitor_port, procs=args.nats_procs or None)
    with tempfile.TemporaryDirectory() as tmp, bus as nats:
        stack = Stack(
            model=model,
            nats_url=nats.url,
            http_port=free_port(),
            metrics_port=free_port(),
            log_dir=Path(args.log_dir or tmp),
            worker_module="free_worker",
            worker_args=[
                *["--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "512"],
                *["--stream-interval", str(args.stream_interval)],
            ],
            gateways=args.gateways,
            extra_env={
                "PYTHONPATH": path,
                "LAMINA_FREE_STEP_MS": str(args.step_ms),
                "LAMINA_FREE_ENGINE": "null" if args.null_engine else "",
            },
        )
        with stack:
            pids = {name: proc.pid for name, proc in stack.procs.items()}
            if args.gateway_core:
                pin_gateways(pids, cpus[-1])
            pids["nats-server"] = nats.pid
            wait_for_workers(stack.metrics_url, 1)
            time.sleep(1.0)  # its first heartbeats settle
            print(
                f"{len(cpus)} cores{'; the gateway alone on the last' * args.gateway_core}; "
                f"{'null' if args.null_engine else 'free'} engine, a {args.step_ms:g} ms step; "
                f"{args.gateways} gateway(s), stream interval {args.stream_interval}; "
                f"{args.tokens}-token completions, {args.seconds:g} s per level; CPU us per "
                "streamed token (idle subtracted), tokens/s, /health p99, bus messages "
                "published per token, each stream's time to first token"
            )
            names = ["worker-0", "nats-server", "gateway", "rest", "client"]
            names += ["floor"] if args.floor else []
            head = " ".join(f"{n:>11}" for n in names)
            print(f"{'streams':>8} {head}   tok/s    health  retried  msgs/tok  TTFT p50/p90")
            by_service, healthy = {}, []
            for clients in args.concurrency:
                row, by_service[clients] = measure(stack, pids, monitor, args, clients)
                if row["health_p99_ms"] <= HEALTHY_P99_MS:
                    healthy.append((row["tokens_per_s"], clients, row["health_p99_ms"]))
                row["rest"] = row.pop("scheduler") + row.pop("telemetry")
                row["gateway"] = sum(row.pop(n) for n in list(row) if n.startswith("gateway"))
                if args.floor:
                    row["floor"] = asyncio.run(floor(nats.url, clients, args.step_ms, args.seconds))
                cells = " ".join(f"{row[n]:11.1f}" for n in names)
                print(
                    f"{clients:8d} {cells} {row['tokens_per_s']:7.0f} "
                    f"{row['health_p99_ms']:6.0f} ms {row['retried']:8.0f} {row['messages']:9.3f}"
                    f"  {row['ttft_ms'][0]:.0f}/{row['ttft_ms'][1]:.0f} ms",
                    flush=True,
                )
            for clients, messages in by_service.items():
                top = ", ".join(f"{name} {count}" for name, count in messages.most_common(6))
                print(f"messages published at {clients} streams: {top}")
            if healthy:
                rate, clients, p99 = max(healthy)
                bound = (
                    "the gateway on a core of its own"
                    if args.gateway_core
                    else "this machine's cores are shared by every process, so this bounds "
                    "the stack here, not one gateway alone"
                )
                print(
                    f"most tokens/s with /health p99 <= {HEALTHY_P99_MS} ms: {rate:.0f} "
                    f"({clients} streams, p99 {p99:.0f} ms; {bound})"
                )
            if args.profile:
                profile(stack, pids, args, args.concurrency[-1], Path(tmp))


def profile(stack: Stack, pids: dict[str, int], args, clients: int, tmp: Path) -> None:
    """One more window at ``clients`` streams, the gateway and the worker sampled by
    py-spy; their hottest functions."""
    spies = {}
    for name in ("gateway", "worker-0"):
        out = tmp / f"{name}.folded"
        spies[name] = (
            out,
            subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "--gil",
                 "--format", "raw", "-r", "200", "-d", str(int(args.seconds)),
                 "-p", str(pids[name]), "-o", str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        )  # fmt: skip
    asyncio.run(load(stack.base_url, clients, args.tokens, args.seconds))
    for name, (out, spy) in spies.items():
        spy.wait(60)
        own, under, total = Counter(), Counter(), 0
        for line in out.read_text().splitlines():
            stack_text, _, count = line.rpartition(" ")
            raw = stack_text.split(";")
            frames = [_frame(f) for f in raw]
            ours = {_frame(f) for f in raw if any(f"/{d}/" in f for d in OURS)}
            samples = int(count)
            total += samples
            own[frames[-1]] += samples
            for frame in ours:
                under[frame] += samples
        print(f"{name}: {total} samples at {clients} streams; own / under, % of samples")
        for frame, samples in own.most_common(args.top):
            print(f"  {100 * samples / total:5.1f}% own   {frame}")
        for frame, samples in under.most_common(args.top * 2):
            print(f"  {100 * samples / total:5.1f}% under {frame}")


OURS = ("gateway", "engine_worker", "engine", "benchmarks")
"""Folders of the frames ``under`` counts: the gateway's and the worker's own (the rest
is the loop, the HTTP server, the bus client and the service wrapper around it all)."""


def _frame(text: str) -> str:
    """``function (path/file.py:line)``, py-spy's, as ``dir/file.py function``."""
    function, _, where = text.partition(" (")
    path = where.rsplit(":", 1)[0].rstrip(")")
    return f"{'/'.join(path.split('/')[-2:])} {function}"


if __name__ == "__main__":
    main()
