"""``lamina up``: the whole stack on one machine, each service its own process.

An embedded ``nats-server`` (unless ``--nats-url`` points at one), one scheduler, one
telemetry, N engine workers and one gateway, all started with the same entry points and
``LAMINA_*`` environment that ``compose.yaml`` uses. It supervises them: a service that
exits (crashed, killed, or a worker stopped by SIGTERM after draining: a rolling restart)
is started again with back-off, the embedded ``nats-server`` on its own port included,
while the others keep serving. Ctrl-C or SIGTERM to ``lamina up`` stops them all, in
order: the gateway first (no new requests), then workers (they drain), then the rest.

The bus is closed by default: the embedded server admits only the identities of a
credential store under ``LAMINA_HOME/nats`` (``lamina.libs.nats_auth``), and each service
connects as its own (each worker as ``worker.<its id>``). ``api.default`` is made for the
first NATS API client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lamina.libs.bus import NatsConfig
from lamina.libs.config import lamina_home, option, parse_config, to_argv
from lamina.libs.lifetime import PARENT_ENV
from lamina.libs.nats_auth import DEPLOYMENT, CredentialStore
from lamina.libs.nats_server import NatsCluster, NatsServer, free_port
from lamina.libs.service import RESTARTS_ENV
from lamina.schemas.v1.stats import WorkerRole
from lamina.services import up_state
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.errors import ModelLoadError
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.gateway.config import GatewayOptions

SERVICES = frozenset({"gateway", "scheduler", "telemetry", "worker"})
NATS_PROCS = 1
"""The embedded NATS server's Go threads. The bus carries a message per engine step per
gateway and a few per request, a small share of one core; with a thread per CPU, Go wakes
idle threads to look for work on each message, CPU the services next to it lose (on a
2-vCPU host, a fifth to a third of nats-server's CPU a token: ``docs/performance.md``, "The data
path, per hop")."""


class StartStopped(Exception):
    """A stack was told to stop while it started."""


def _never() -> bool:
    return False


@dataclass
class Stack:
    """The services as child processes. ``start()`` returns once the gateway is ready."""

    model: Path
    workers: int = 1
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    metrics_port: int = 9400
    nats_url: str | None = None
    nats_port: int = 0
    """Port of the embedded NATS server when ``nats_url`` is None (0: any free port)."""
    credentials: Path | None = None
    """A credential store: each service connects as its own identity, and the embedded
    server admits only the store's. None: an open bus."""
    nats_tls: tuple[str, str, str] | None = None
    """(certificate, key, CA) PEM files: the embedded server speaks only TLS with that
    certificate, and the services verify it with that CA."""
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)
    worker_module: str = "lamina.services.engine_worker"
    """What each worker runs as (``python -m``): another module only to put something
    else behind the worker's shell (``benchmarks/free_worker.py``: an engine whose model
    costs nothing)."""
    gateway_args: list[str] = field(default_factory=list)
    gateways: int = 1
    """Gateway processes, all on ``http_port`` (``--http-reuse-port``: the kernel spreads
    connections between them), named ``gateway``, ``gateway-1``, ...: where one process's
    event loop is not enough to stream every token."""
    telemetry_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    services: frozenset[str] = SERVICES
    """The services to run (``lamina node`` runs a host's share); workers only with
    ``worker`` among them."""
    nats_host: str = "127.0.0.1"
    """Address the embedded NATS server listens on."""
    nats_procs: int = NATS_PROCS
    """Threads the embedded NATS server runs Go code on (``GOMAXPROCS``; 0: one per CPU)."""
    cluster: NatsCluster | None = None
    """The embedded server's place in a NATS cluster (None: it stands alone)."""
    peer_urls: tuple[str, ...] = ()
    """The other nodes' client URLs: every service gets them after this node's, so it
    reconnects to another node when this one is lost."""
    worker_device: Callable[[int], str] | None = None
    """Worker ``index``'s ``--device`` (None: every worker the engine flags' own): each
    group of ranks on CUDA takes the next devices after the previous group's."""
    worker_prefix: str = "worker"
    """Worker ids are ``<prefix>-<index>``: unique across the hosts of a cluster."""
    prefill_workers: int = 0
    """Disaggregated serving: the first this-many workers are ``--role prefill``, the
    others ``--role decode`` (0: every worker has ``worker_role``)."""
    worker_role: str = "mixed"
    """Every worker's ``--role`` where ``prefill_workers`` is 0 (a host of a
    disaggregated cluster whose workers all do one job)."""
    scheduler_id: str = ""
    """The scheduler replica's id (empty: its own default, ``<host>-<pid>``)."""
    stages: tuple[tuple[str, int], ...] = ()
    """Pipeline stages this host runs for workers on other hosts, as (worker id, stage):
    each a stage host (``lamina stage``) on the bus as that worker, on ``stage_device``."""
    stage_device: str = "cpu"
    host_name: str = ""
    """This host's name in its stage hosts' reports (empty: the host name)."""
    nats: NatsServer | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    specs: dict[str, tuple[str, list[str], str]] = field(default_factory=dict)
    """How each service was started (module, arguments, identity), to start it again."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts so far, per service (``nats-server`` included)."""
    _due: dict[str, float] = field(default_factory=dict)  # service -> when to restart it

    @property
    def base_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.http_host}:{self.metrics_port}/metrics"

    def nats_config(self, identity: str) -> NatsConfig:
        """How a process connects to this stack's bus as ``identity`` (made if new, and
        then admitted by the running embedded server)."""
        ca = self.nats_tls[2] if self.nats_tls else ""
        servers = ",".join([self.nats_url or "", *self.peer_urls])
        if self.credentials is None:
            return NatsConfig(servers, nats_tls_ca=ca)
        store = CredentialStore(self.credentials)
        new = not store.path(identity).exists()
        (path,) = store.ensure(identity)
        if new and self.nats is not None:
            self.nats.reload()
            time.sleep(0.2)  # the reload is asynchronous; a client this early is refused
        return NatsConfig(servers, nats_credential=str(path), nats_tls_ca=ca)

    def _spawn(self, name: str, module: str, args: list[str], identity: str) -> subprocess.Popen:
        bus = self.nats_config(identity)
        env = {
            **os.environ,
            "LAMINA_NATS_URL": bus.nats_url,
            "LAMINA_NATS_CREDENTIAL": bus.nats_credential,
            "LAMINA_NATS_TLS_CA": bus.nats_tls_ca,
            RESTARTS_ENV: str(self.restarts.get(name, 0)),  # telemetry counts them
            PARENT_ENV: str(os.getpid()),  # it dies with this process, however it ends
            **(self.worker_env() if module == self.worker_module else {}),
            **self.extra_env,
        }
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        self.procs[name] = proc
        self.specs[name] = (module, args, identity)
        return proc

    def worker_env(self) -> dict[str, str]:
        """A worker's OpenMP threads, where this host runs several and nothing set them
        (``OMP_NUM_THREADS``): its share of the CPUs this process may run on. Each engine
        would otherwise start a thread per CPU, and every parallel region of one engine's
        step would end waiting for a thread of its own that another engine's had taken
        the core from (two workers of the tiny model on two cores, 16 requests at once:
        1.0-2.5 s against 0.26-0.30 s with one thread each)."""
        if self.workers < 2 or "OMP_NUM_THREADS" in os.environ:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // self.workers))}

    def supervise(self) -> list[str]:
        """Restart what exited, with back-off (1 s doubling to 30 s per service), the
        embedded ``nats-server`` on its own port included; the rest keep serving. Call it
        periodically; returns what it logged."""
        now, said = time.monotonic(), []
        if self.nats is not None and not self.nats.running:
            said.append(self._restart_later("nats-server", None, now))
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                said.append(self._restart_later(name, proc.returncode, now))
        for name, due in list(self._due.items()):
            if due <= now:
                del self._due[name]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                if name == "nats-server":
                    self.nats.start()
                else:
                    self._spawn(name, *self.specs[name])
                said.append(f"restarted {name} (restart {self.restarts[name]})")
        return [line for line in said if line]

    def _restart_later(self, name: str, code: int | None, now: float) -> str:
        if name in self._due:
            return ""
        delay = min(30.0, 2.0 ** self.restarts.get(name, 0))
        self._due[name] = now + delay
        self.procs.pop(name, None)
        how = "stopped" if code is None else f"exited with {code}"
        return f"{name} {how}; restarting it in {delay:g}s"

    def worker_id(self, index: int) -> str:
        return f"{self.worker_prefix}-{index}"

    def role_of(self, index: int) -> list[str]:
        """Worker ``index``'s ``--role`` flag (none: its own default, mixed)."""
        if self.prefill_workers:
            return ["--role", "prefill" if index < self.prefill_workers else "decode"]
        return [] if self.worker_role == "mixed" else ["--role", self.worker_role]

    def start_worker(self, index: int) -> subprocess.Popen:
        wid = self.worker_id(index)
        return self._spawn(
            wid,
            self.worker_module,
            ["--worker-id", wid, "--model", str(self.model), *self.worker_args]
            + (["--device", self.worker_device(index)] if self.worker_device else [])
            + self.role_of(index),
            f"worker.{wid}",
        )

    def start_stage(self, worker_id: str, stage: int) -> subprocess.Popen:
        """A stage host for pipeline stage ``stage`` of worker ``worker_id``."""
        args = ["--worker-id", worker_id, "--stage", str(stage), "--model", str(self.model)]
        args += ["--device", self.stage_device]
        args += ["--host-name", self.host_name] if self.host_name else []
        module = "lamina.services.engine_worker.stage_host"
        return self._spawn(f"stage-{worker_id}-{stage}", module, args, f"worker.{worker_id}")

    def gateway_name(self, index: int) -> str:
        return "gateway" if index == 0 else f"gateway-{index}"

    def start_gateway(self, index: int) -> subprocess.Popen:
        shared = ["--http-reuse-port"] if self.gateways > 1 else []
        args = ["--model", str(self.model), "--http-host", self.http_host]
        args += ["--http-port", str(self.http_port), *shared, *self.gateway_args]
        return self._spawn(self.gateway_name(index), "lamina.services.gateway", args, "gateway")

    def start_scheduler(self, scheduler_id: str) -> subprocess.Popen:
        """Another scheduler replica (the queue group splits submits between replicas)."""
        return self._spawn(
            f"scheduler-{scheduler_id}",
            "lamina.services.scheduler",
            ["--scheduler-id", scheduler_id],
            "scheduler",
        )

    def start(self, timeout: float = 180.0, should_stop: Callable[[], bool] = _never) -> Stack:
        """Start everything (``with Stack(...)`` already does); once only: a second start
        would orphan the first processes and run two workers under one id on one bus."""
        if self.procs:
            raise RuntimeError("the stack is already started")
        if self.nats_url is None:
            tls = self.nats_tls[:2] if self.nats_tls else None
            self.nats = NatsServer(
                port=self.nats_port or None,
                host=self.nats_host,
                tls=tls,
                cluster=self.cluster,
                procs=self.nats_procs or None,
            )
            if self.credentials is not None:
                store = CredentialStore(self.credentials)
                workers = (f"worker.{self.worker_id(i)}" for i in range(self.workers))
                store.ensure(*DEPLOYMENT, *workers)
                self.nats.config = store.write_server_config(
                    self.nats.host, self.nats.port, cluster=self.cluster
                )
            self.nats.start()
            self.nats_url = self.nats.url
        if "scheduler" in self.services:
            named = ["--scheduler-id", self.scheduler_id] if self.scheduler_id else []
            self._spawn("scheduler", "lamina.services.scheduler", named, "scheduler")
        if "telemetry" in self.services:
            self._spawn(
                "telemetry",
                "lamina.services.telemetry",
                [
                    "--http-host",
                    self.http_host,
                    "--http-port",
                    str(self.metrics_port),
                    *self.telemetry_args,
                ],
                "telemetry",
            )
        if "worker" in self.services:
            for index in range(self.workers):
                self.start_worker(index)
        for worker_id, stage in self.stages:
            self.start_stage(worker_id, stage)
        if "gateway" in self.services:
            for index in range(self.gateways):
                self.start_gateway(index)
        self.wait_ready(timeout, should_stop)
        return self

    def wait_ready(self, timeout: float, should_stop: Callable[[], bool] = _never) -> None:
        """Until the gateway says it is ready; without a gateway, until the services have
        got past their imports (a worker's model loads afterwards). ``should_stop()``
        true (a SIGTERM meanwhile) stops everything and raises :class:`StartStopped`."""
        deadline = time.monotonic() + timeout
        settled = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if should_stop():
                self.stop()
                raise StartStopped("stopped during start-up")
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
            if "gateway" not in self.services:
                if time.monotonic() >= settled:
                    return
                time.sleep(0.2)
                continue
            if self._gateways_listen():
                try:
                    with urllib.request.urlopen(self.base_url + "/ready", timeout=1) as response:
                        if response.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the stack was not ready within {timeout:g}s")

    def _gateways_listen(self) -> bool:
        """Every gateway process listens on the HTTP port (true at once for one gateway:
        its ``/ready`` says so): ``/ready`` alone would answer from whichever listens."""
        if self.gateways == 1:
            return True
        names = [self.gateway_name(i) for i in range(self.gateways)]
        return all(listens(self.procs[n].pid, self.http_port) for n in names if n in self.procs)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM in order (gateways, workers, scheduler, telemetry), then the NATS server."""
        order = sorted(
            self.procs, key=lambda n: (not n.startswith("gateway"), not n.startswith("worker"))
        )
        for name in order:
            self.terminate(name, timeout)
        if self.nats is not None:
            self.nats.stop()

    def terminate(self, name: str, timeout: float = 30.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class UpConfig:
    """Run the whole stack locally: an embedded NATS server (unless --nats-url), one
    scheduler, one telemetry, N engine workers and one gateway. Every engine setting of
    `lamina worker` is also a flag here and goes to each worker, and every setting of how
    `lamina gateway` serves goes to the gateway."""

    workers: int = option(1, "engine workers to start")
    prefill_workers: int = option(
        0,
        "disaggregated serving: this many of the workers compute prompts (--role prefill) "
        "and the others stream from the KV they fetch (--role decode); 0: all mixed",
    )
    worker_role: str = option(
        "mixed",
        "every worker's --role (mixed, prefill or decode): a host of a disaggregated "
        "cluster whose workers all do one job; --prefill-workers splits one host's instead",
    )
    gateways: int = option(
        1,
        "gateway processes, all on --http-port (the kernel spreads connections between "
        "them): more where one process cannot stream every token",
    )
    stream_interval: int = option(
        1,
        "tokens each decoding stream sends at once (lamina worker's --stream-interval; "
        "vLLM's): above 1, less CPU per token outside the engine, in coarser chunks",
    )
    model_name: str = option("", "served model name (default: the model directory's name)")
    http_host: str = option("127.0.0.1", "address the gateway and telemetry listen on")
    http_port: int = option(8000, "the gateway's HTTP port (the OpenAI API)")
    metrics_port: int = option(9400, "telemetry's HTTP port (/metrics, /v1/cluster)")
    nats_url: str = option("", "use this NATS server instead of starting one")
    nats_port: int = option(4222, "port of the embedded NATS server (0: any free port)")
    nats_procs: int = option(
        NATS_PROCS,
        "threads the embedded NATS server runs Go code on (GOMAXPROCS; 0: one per CPU)",
    )
    api_key: str = option("", "API keys the gateway requires (comma-separated; none: open)")
    api_key_file: str = option(
        "", "file of the gateway's API keys with their limits (lamina gateway's --api-key-file)"
    )
    api_client_file: str = option(
        "", "NATS API clients' priorities and limits (lamina gateway's --api-client-file)"
    )
    metrics_api_key: str = option(
        "",
        "keys telemetry's /metrics and /v1/cluster require (comma-separated; default: the "
        "gateway's keys, when it has any)",
    )
    metrics_compat: str = option(
        "", "telemetry also serves vLLM's metric names and labels: vllm (empty: Lamina's only)"
    )
    nats_auth: bool = option(
        True, "the embedded NATS server admits only credentials under LAMINA_HOME/nats"
    )
    nats_tls_cert: str = option("", "serve the embedded NATS over TLS with this certificate")
    nats_tls_key: str = option("", "its private key (PEM)")
    nats_tls_ca: str = option("", "the CA the services verify NATS's certificate with")
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayOptions = field(default_factory=GatewayOptions)


def preflight(config: UpConfig, model: Path, ports: list[tuple[str, str, int]]) -> str | None:
    """What would stop the stack, found before any process is spawned: a taken port (each
    ``(flag, host, port)`` of ``ports``), or a model directory that cannot be served. None
    when all is well."""
    for flag, host, port in ports:
        if port and not port_is_free(host, port):
            return f"port {port} on {host} is in use ({flag})"
    if config.gateways < 1 or config.stream_interval < 1:
        return "--gateways and --stream-interval are at least 1"
    if config.nats_procs < 0:
        return f"--nats-procs {config.nats_procs}: 0 (one per CPU) or more"
    if not 0 <= config.prefill_workers <= config.workers:
        return f"--prefill-workers {config.prefill_workers}: 0 to --workers ({config.workers})"
    if WorkerRole(config.worker_role) == WorkerRole.UNKNOWN:
        return f"--worker-role must be mixed, prefill or decode, not {config.worker_role!r}"
    if config.prefill_workers and config.worker_role != "mixed":
        return "--prefill-workers splits the workers' roles; --worker-role gives them all one"
    if bool(config.nats_tls_cert) != bool(config.nats_tls_key):
        return "--nats-tls-cert and --nats-tls-key go together"
    for flag, path in (
        ("--nats-tls-cert", config.nats_tls_cert),
        ("--nats-tls-key", config.nats_tls_key),
        ("--nats-tls-ca", config.nats_tls_ca),
    ):
        if path and not Path(path).is_file():
            return f"{path} is not a file ({flag})"
    if not model.is_dir():
        return f"model directory {model} does not exist (--model)"
    try:
        ModelConfig.from_dir(model)
    except ModelLoadError as exc:
        return f"model {model} cannot be served: {exc}"
    if not any(model.glob("*.safetensors")):
        return f"model {model} has no *.safetensors weights"
    if not (model / "tokenizer.json").is_file():
        return f"model {model} has no tokenizer.json"
    return None


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (Linux's /proc;
    elsewhere, assumed)."""
    if not os.path.isdir("/proc"):
        return True
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local_port, state, inode = (
                    int(fields[1].rsplit(":", 1)[1], 16),
                    fields[3],
                    fields[9],
                )
                if local_port == port and state == "0A" and inode in inodes:  # 0A: LISTEN
                    return True
    return False


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _gateway_policies(config: UpConfig) -> list[str]:
    """The gateway's flags for who may call it, and with what limits."""
    flags = {
        "--api-key": config.api_key,
        "--api-key-file": config.api_key_file,
        "--api-client-file": config.api_client_file,
    }
    return [item for flag, value in flags.items() if value for item in (flag, value)]


def _telemetry_keys(config: UpConfig) -> list[str]:
    """Telemetry's keys: its own, or else the gateway's (a stack whose API needs a key does
    not show its cluster to anyone)."""
    if config.metrics_api_key:
        return ["--metrics-api-key", config.metrics_api_key]
    flags = {"--metrics-api-key": config.api_key, "--metrics-api-key-file": config.api_key_file}
    return [item for flag, value in flags.items() if value for item in (flag, value)]


def stack_of(config: UpConfig, model: Path, **placement: object) -> Stack:
    """The :class:`Stack` that ``config`` describes; ``placement`` sets the rest of its
    fields (``lamina node``: the services, addresses and cluster of one host)."""
    names = ["--model-name", config.model_name] if config.model_name else []
    fields: dict[str, object] = dict(
        model=model,
        workers=config.workers,
        prefill_workers=config.prefill_workers,
        worker_role=config.worker_role,
        http_host=config.http_host,
        http_port=config.http_port,
        metrics_port=config.metrics_port,
        nats_url=config.nats_url or None,
        nats_port=config.nats_port,
        nats_procs=config.nats_procs,
        credentials=lamina_home() / "nats" if config.nats_auth else None,
        nats_tls=(config.nats_tls_cert, config.nats_tls_key, config.nats_tls_ca)
        if config.nats_tls_cert
        else None,
        worker_args=[
            *to_argv(dataclasses.replace(config.engine, model=None)),
            *names,
            *(
                ["--stream-interval", str(config.stream_interval)]
                if config.stream_interval > 1
                else []
            ),
        ],
        gateways=config.gateways,
        gateway_args=[*names, *_gateway_policies(config), *to_argv(config.gateway)],
        telemetry_args=[
            *(["--metrics-compat", config.metrics_compat] if config.metrics_compat else []),
            *_telemetry_keys(config),
        ],
        worker_device=_group_devices(config.engine),
    )
    return Stack(**{**fields, **placement})


def _group_devices(engine: EngineConfig) -> Callable[[int], str] | None:
    """Where each worker's rank 0 goes when its group spans CUDA devices: worker ``i`` of
    groups of ``n`` ranks (``T`` × ``P``) starts at device ``base + i * n`` (its ranks take
    the ``n`` devices from there). None otherwise: every worker shares the configured
    device."""
    kind, _, index = engine.device.partition(":")
    size = engine.tensor_parallel_size * engine.pipeline_parallel_size
    if kind != "cuda" or size == 1:
        return None
    base = int(index or 0)
    return lambda worker: f"cuda:{base + worker * size}"


def serve(stack: Stack, prog: str, banner: Callable[[], list[str]]) -> int:
    """Start ``stack``, print ``banner()``, supervise until SIGTERM or Ctrl-C, stop it."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start(should_stop=lambda: stopping)
    except StartStopped:
        print("stopped during start-up", file=sys.stderr)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        if not stopping:
            print(f"{prog}: {exc} (logs: each service's output above)", file=sys.stderr)
            return 1
        # Ctrl-C during start-up: the services got it too and stopped; not a failure.
        print("stopped during start-up", file=sys.stderr)
        return 0
    print("\n".join([*banner(), "Ctrl-C stops everything."]), flush=True)
    recorded = None
    try:
        while not stopping:
            state = _state_of(stack)
            if state != recorded:  # at start, and when supervision restarted nats-server
                up_state.record(state)
                recorded = state
            for line in stack.supervise():
                print(line, file=sys.stderr, flush=True)
            time.sleep(0.5)
    finally:
        up_state.forget(os.getpid())
        stack.stop()
    return 0


def _state_of(stack: Stack) -> up_state.UpState:
    """What the machine's other commands are told of ``stack`` (``up_state``)."""
    return up_state.UpState(
        pid=os.getpid(),
        nats_url=",".join([stack.nats_url or "", *stack.peer_urls]),
        nats_tls_ca=stack.nats_tls[2] if stack.nats_tls else "",
        nats_pid=stack.nats.pid if stack.nats is not None else 0,
        credentials=str(stack.credentials or ""),
    )


def nats_banner(stack: Stack) -> list[str]:
    """How a NATS API client reaches ``stack``'s bus."""
    if stack.credentials is None:
        return [f"  NATS         {stack.nats_url}  (request API: lamina.v1.api.generate)"]
    api = stack.nats_config("api.default").nats_credential
    return [
        f"  NATS         {stack.nats_url}  (request API: lamina.v1.api.generate.default",
        f"               as {api}; more clients: lamina creds add api.<name>)",
    ]


def main(argv: list[str] | None = None) -> int:
    config = parse_config(UpConfig, argv, prog="lamina up")
    # The default model is made once, here, before the workers race to create it.
    model = config.engine.model or ensure_default_model()
    ports = [
        ("--http-port", config.http_host, config.http_port),
        ("--metrics-port", config.http_host, config.metrics_port),
    ]
    if not config.nats_url:
        ports.append(("--nats-port", config.http_host, config.nats_port))
    problem = preflight(config, model, ports)
    if problem is not None:
        print(f"lamina up: {problem}", file=sys.stderr)
        return 2
    stack = stack_of(config, model)
    return serve(
        stack,
        "lamina up",
        lambda: [
            f"Lamina is up: {config.workers} worker(s) serving {config.model_name or model.name}",
            f"  OpenAI API   {stack.base_url}/v1  (try: curl {stack.base_url}/v1/models)",
            *nats_banner(stack),
            f"  metrics      {stack.metrics_url}",
        ],
    )


__all__ = ["Stack", "UpConfig", "free_port", "main"]
