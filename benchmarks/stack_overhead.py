"""What the distributed stack costs: HTTP → gateway → scheduler → worker vs the same
engine called in-process, on the same model and workload, in one run.

* throughput: N concurrent streaming requests (greedy, ``ignore_eos``), output tokens/s.
* TTFT: sequential single requests (an idle system) on one keep-alive connection, as a
  pooled client sends them (``--new-connections``: a new one each), time to the first
  streamed token; the stack's p50/p99 minus the in-process engine's is the added
  latency. Each prompt goes to the in-process engine and then through the stack, so the
  machine's drift (a few ms over a minute on the 2-vCPU VM) falls on both sides alike.
  Both sides pause ``--ttft-gap-ms`` before each request, so both start from an idle
  engine (a back-to-back in-process loop would find torch's threads spinning and its
  caches warm, which no request arriving at an idle server does).

``--trace-export`` runs two stacks at once, one with tracing off and one exporting every
span of a sampled request to a local OTLP sink, and sends each prompt three ways (their
order turning): to the first stack; to the second, sampled (it starts the trace); and to
the second as a caller that does not sample would (``traceparent`` flags ``00``). The
cost of tracing is the sampled request against the unsampled one on the same stack,
prompt by prompt: two stacks started alike still differ by a few ms of TTFT between
invocations (why is not known), more than the effect, so the comparison
across stacks is printed too but is not the measure.

The model is the ``small`` preset (38.5M parameters), the engine benchmark's model
(``engine_vs_hf.py``), unless ``--model``. On the ``tiny`` default model of ``make up``
(~1M parameters) the engine needs only 0.4-0.5 ms of CPU per token, so the HTTP client,
gateway and ``nats-server`` sharing its two cores cost it a large share of its throughput
(see ``docs/performance.md``).

Prints medians of ``--runs`` runs and the ratios. Not a test: run it by hand.

    .venv/bin/python benchmarks/stack_overhead.py
    .venv/bin/python benchmarks/stack_overhead.py --model ~/.cache/lamina/models/lamina-tiny
    .venv/bin/python benchmarks/stack_overhead.py --trace-export --runs 10 --requests 16 \
        --ttft-requests 60 --model ~/.cache/lamina/models/lamina-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import multiprocessing
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from lamina.libs.nats_server import free_port
from lamina.schemas.v1 import subjects
from lamina.schemas.v1.control import ControlAck, ResetPrefixCache
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.launcher import Stack

Workload = list[tuple[list[int], int]]


def workload(n: int, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
        for _ in range(n)
    ]


def engine_throughput(engine: Engine, work: Workload) -> float:
    started = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(
            f"t{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    produced = 0
    while engine.has_work():
        produced += len(engine.step().outputs)
    return produced / (time.perf_counter() - started)


def engine_ttft(engine: Engine, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.add_request("ttft", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_work():
        if engine.step().outputs:
            break
    return time.perf_counter() - started


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True)
class Target:
    """Where requests go: a stack's HTTP address, and the trace flags a caller's W3C
    ``traceparent`` carries (None: no header, the stack's sampler decides)."""

    name: str
    host: str
    port: int
    trace_flags: str | None = None

    def headers(self) -> bytes:
        if self.trace_flags is None:
            return b""
        ids = f"{random.getrandbits(128):032x}-{random.getrandbits(64):016x}"
        return f"traceparent: 00-{ids}-{self.trace_flags}\r\n".encode()


async def http_stream(
    target: Target, prompt: list[int], n: int, connection: Connection | None = None
) -> tuple[float, int]:
    """One streaming completion: (seconds to the first token, completion tokens).

    A minimal HTTP/1.1 client (chunked SSE parsed by hand): the client shares the
    machine's two cores with the stack, and ``httpx`` spent ~0.3 ms of CPU per streamed
    token, which the stack then lost; the in-process side has no client at all. With
    ``connection`` it sends on that open keep-alive connection, as a pooled client (the
    ``openai`` client, ``vllm bench serve``) does; without, it opens and closes its own.
    """
    body = msgspec.json.encode(
        {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    started, first, usage, pending = time.perf_counter(), None, 0, b""
    reader, writer = connection or await asyncio.open_connection(target.host, target.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"%sContent-Length: %d\r\n\r\n%s"
        % (target.host.encode(), target.headers(), len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200" and b"chunked" in head.lower(), head
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        pending += (await reader.readexactly(size + 2))[:-2]
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: {"):
                continue
            chunk = msgspec.json.decode(event[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    await reader.readexactly(2)  # the last chunk's CRLF
    if connection is None:
        writer.close()
    return first if first is not None else time.perf_counter() - started, usage


async def stack_throughput(target: Target, work: Workload) -> float:
    started = time.perf_counter()
    results = await asyncio.gather(*(http_stream(target, p, n) for p, n in work))
    elapsed = time.perf_counter() - started
    produced = sum(tokens for _, tokens in results)
    assert produced == sum(n for _, n in work), (produced, sum(n for _, n in work))
    return produced / elapsed


async def paired_ttfts(
    engine: Engine,
    targets: list[Target],
    prompts: list[list[int]],
    gap: float,
    keep_alive: bool = True,
) -> tuple[list[float], list[list[float]]]:
    """(in-process, per target) TTFTs: each prompt first to the engine, then to each
    target (their order turning with each prompt), one at a time, ``gap`` apart. Stack
    requests share one keep-alive connection per target (as a client with a pool sends
    them) unless ``keep_alive`` is off (a new connection each)."""
    connections = [
        await asyncio.open_connection(t.host, t.port) if keep_alive else None for t in targets
    ]
    local: list[float] = []
    remote: list[list[float]] = [[] for _ in targets]
    for i, prompt in enumerate(prompts):
        await asyncio.sleep(gap)
        local.append(engine_ttft(engine, prompt))
        for k in range(len(targets)):
            which = (i + k) % len(targets)
            await asyncio.sleep(gap)
            # Its own first token per target: two targets on one stack share its prefix
            # cache, and the second would find the whole prompt cached.
            own = [prompt[0] + which, *prompt[1:]]
            ttft, _ = await http_stream(targets[which], own, 1, connections[which])
            remote[which].append(ttft)
    for connection in connections:
        if connection is not None:
            connection[1].close()
    return local, remote


async def reset_worker_cache(stack: Stack) -> None:
    """The worker's ``ResetPrefixCache`` control command, over the bus, as an operator."""
    bus = await stack.nats_config("operator").connect("benchmark")
    ack = await bus.request(
        subjects.worker_control("worker-0"), ResetPrefixCache(), ControlAck, timeout=10
    )
    assert ack.ok, ack
    await bus.close()


def service_env(pairs: list[str]) -> dict[str, str]:
    """``--service-env KEY=VALUE`` arguments as an environment mapping."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--service-env wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


class OtlpSink:
    """A local OTLP/HTTP trace receiver that takes every export and keeps only counts:
    the services export as they would to a collector, and the measurement includes it.
    It runs in a process of its own, as a collector would: in this one its thread would
    share the interpreter with the client and the in-process engine being timed."""

    def __init__(self) -> None:
        self._counts = multiprocessing.Array("q", 2)  # requests, bytes
        ready = multiprocessing.Event()
        self._port = multiprocessing.Value("i", 0)
        self._process = multiprocessing.Process(
            target=_serve_sink, args=(self._counts, self._port, ready), daemon=True
        )
        self._process.start()
        ready.wait(10)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port.value}"

    @property
    def requests(self) -> int:
        return self._counts[0]

    @property
    def bytes(self) -> int:
        return self._counts[1]


def _serve_sink(counts, port, ready) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            with counts.get_lock():
                counts[0] += 1
                counts[1] += len(body)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port.value = server.server_address[1]
    ready.set()
    server.serve_forever()


EXPORT_SETTLE_S = 6.0
"""Pause before each throughput run with tracing on: the span processor exports every 5 s,
so one run's spans are not exported during the next."""


def p50_difference_interval(
    a: list[float], b: list[float], draws: int = 2000
) -> tuple[float, float]:
    """A 95% bootstrap interval for p50(a) - p50(b), ``a`` and ``b`` paired by prompt
    (the prompts resampled together): how far one invocation's p50 difference resolves."""
    rng = random.Random(7)
    n, differences = len(a), []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        differences.append(pct([a[i] for i in picks], 0.5) - pct([b[i] for i in picks], 0.5))
    return pct(differences, 0.025), pct(differences, 0.975)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: the 'small' preset)")
    parser.add_argument("--device", default="cpu", help="the engine's, both sides (cuda)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype, both sides")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--ttft-requests", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--ttft-gap-ms", type=float, default=20.0, help="idle pause before each TTFT request"
    )
    parser.add_argument(
        "--new-connections",
        action="store_true",
        help="TTFT requests each on a new connection (default: one keep-alive connection)",
    )
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the stack's services (repeatable)",
    )
    parser.add_argument(
        "--trace-export",
        action="store_true",
        help="two stacks at once, tracing off and exporting every sampled span over OTLP/HTTP "
        "to a local sink; each prompt to the first, and to the second sampled and unsampled: "
        "the cost of tracing",
    )
    args = parser.parse_args()
    env = service_env(args.service_env)
    variants = {"stack": env}
    sink = None
    if args.trace_export:
        sink = OtlpSink()
        variants = {
            "tracing off": env,
            "export on": {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint},
        }

    model = args.model or ensure_default_model("small")
    gap = args.ttft_gap_ms / 1e3
    config = EngineConfig(
        model=model,
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        device=args.device,
        dtype=args.dtype,
    )
    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    work = workload(args.requests, vocab)
    rng = random.Random(1)
    ttft_prompts = [
        [rng.randrange(3, vocab - 8) for _ in range(64)] for _ in range(args.ttft_requests)
    ]
    print(
        f"model {model.name}; {len(work)} concurrent requests, prompts 32-256, outputs "
        f"32-128 ({sum(n for _, n in work)} output tokens); TTFT over "
        f"{len(ttft_prompts)} sequential 64-token prompts, {args.ttft_gap_ms:g} ms apart"
    )

    engine_throughput(engine, work[:4])  # warm-up
    worker_args = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)]
    worker_args += ["--device", args.device, "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as running:
        stacks = {}
        for name, extra in variants.items():
            where = Path(logs) / name.replace(" ", "-")
            stacks[name] = running.enter_context(
                Stack(
                    model=model,
                    http_port=free_port(),
                    metrics_port=free_port(),
                    log_dir=where,
                    credentials=where / "nats",  # the closed bus lamina up runs
                    worker_args=worker_args,
                    extra_env=extra,
                )
            )
        if sink is None:
            targets = [Target("stack", stacks["stack"].http_host, stacks["stack"].http_port)]
        else:
            off, on = stacks["tracing off"], stacks["export on"]
            targets = [
                Target("tracing off", off.http_host, off.http_port),
                Target("sampled", on.http_host, on.http_port),
                Target("unsampled", on.http_host, on.http_port, trace_flags="00"),
            ]
        for target in targets:
            asyncio.run(stack_throughput(target, work[:4]))  # warm-up
        theirs: list[float] = []
        ours: dict[str, list[float]] = {t.name: [] for t in targets}
        ttft_local: list[float] = []
        ttft_stack: dict[str, list[float]] = {t.name: [] for t in targets}
        p50_runs: dict[str, list[float]] = {t.name: [] for t in targets}
        for run in range(args.runs):
            engine.reset_prefix_cache()
            theirs.append(engine_throughput(engine, work))
            for k in range(len(targets)):  # none always goes first
                target = targets[(run + k) % len(targets)]
                for stack in stacks.values():
                    asyncio.run(reset_worker_cache(stack))  # every run computes every prompt
                if sink is not None:
                    time.sleep(EXPORT_SETTLE_S)  # the last run's spans are exported by now
                ours[target.name].append(asyncio.run(stack_throughput(target, work)))
            engine.reset_prefix_cache()
            for stack in stacks.values():
                asyncio.run(reset_worker_cache(stack))
            local, remote = asyncio.run(
                paired_ttfts(engine, targets, ttft_prompts, gap, not args.new_connections)
            )
            ttft_local += local
            for target, ttfts in zip(targets, remote, strict=True):
                ttft_stack[target.name] += ttfts
                p50_runs[target.name].append(pct(ttfts, 0.5))
            said = ", ".join(f"{t.name} {ours[t.name][-1]:.1f} tok/s" for t in targets)
            print(f"  run {run + 1}: in-process {theirs[-1]:.1f} tok/s, {said}")
    b = statistics.median(theirs)
    losses = {}
    for name, rates in ours.items():
        a = statistics.median(rates)
        losses[name] = (1 - a / b) * 100
        print(
            f"throughput (median of {args.runs}), {name}: {a:.1f} tok/s vs in-process {b:.1f} "
            f"-> ratio {a / b:.3f} ({losses[name]:+.1f}% loss)"
        )
    added = {}
    for name, ttfts in ttft_stack.items():
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            s, e = pct(ttfts, q) * 1e3, pct(ttft_local, q) * 1e3
            added[name, label] = s - e
            print(
                f"TTFT {label}, {name}: {s:.2f} ms vs in-process {e:.2f} ms -> added {s - e:.2f} ms"
            )
    if sink is not None:
        for a, b in (
            ("sampled", "unsampled"),
            ("sampled", "tracing off"),
            ("unsampled", "tracing off"),
        ):
            paired = [x - y for x, y in zip(ttft_stack[a], ttft_stack[b], strict=True)]
            where = "same stack" if "tracing off" not in b else "two stacks"
            low, high = p50_difference_interval(ttft_stack[a], ttft_stack[b])
            print(
                f"TTFT, {a} minus {b} ({where}): prompt by prompt, median "
                f"{statistics.median(paired) * 1e3:+.2f} ms over {len(paired)} prompts; "
                f"p50 difference 95% interval {low * 1e3:+.2f} to {high * 1e3:+.2f} ms"
            )
        print(
            f"tracing cost (sampled vs unsampled, same stack): throughput "
            f"{losses['sampled'] - losses['unsampled']:+.1f} points, p50 TTFT "
            f"{added['sampled', 'p50'] - added['unsampled', 'p50']:+.2f} ms, p99 "
            f"{added['sampled', 'p99'] - added['unsampled', 'p99']:+.2f} ms; "
            f"{sink.requests} OTLP requests, {sink.bytes} bytes received"
        )
        # Run by run, both sides measured in the same run, seconds apart: what one invocation
        # resolves on a machine whose speed drifts between invocations.
        ratios = [s / u for s, u in zip(ours["sampled"], ours["unsampled"], strict=True)]
        steps = [
            (s - u) * 1e3 for s, u in zip(p50_runs["sampled"], p50_runs["unsampled"], strict=True)
        ]
        print(
            f"tracing cost run by run ({args.runs} runs, sampled vs unsampled): throughput "
            f"ratio median {statistics.median(ratios):.3f} (range {min(ratios):.3f} to "
            f"{max(ratios):.3f}), p50 TTFT difference median {statistics.median(steps):+.2f} ms "
            f"(range {min(steps):+.2f} to {max(steps):+.2f})"
        )


if __name__ == "__main__":
    main()
