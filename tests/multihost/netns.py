"""Test hosts on this machine: Linux network namespaces on one bridge, each with its own
address (root only; :func:`available` says whether this machine can make them).

``with TestHosts(3) as hosts:`` makes a bridge, and per host a namespace whose ``eth0`` is
one end of a veth pair (the other end on the bridge) with address ``10.<n>.0.<i>``; the
bridge itself has ``.254``, so this process (in the root namespace) reaches every host.
:meth:`Host.spawn` runs a process inside a host; :meth:`Host.kill` kills everything in it
(a lost machine); :meth:`Host.link` takes its cable out and puts it back (a partition).
Everything made is removed on exit, processes first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when test hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"lmprobe{os.getpid() % 10000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One test host: a network namespace with one address."""

    name: str
    netns: str
    veth: str
    """The root-namespace end of its cable (on the bridge)."""
    address: str
    log_dir: Path

    def spawn(self, args: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        """Run ``args`` inside this host, output to ``<log_dir>/<log>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{log}.log", "ab")  # noqa: SIM115 - owned by the child
        return subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def pids(self) -> list[int]:
        listed = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(pid) for pid in listed]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process in this host (SIGKILL: the machine is gone)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait_empty(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def link(self, up: bool) -> None:
        """Connect this host to the bridge, or cut it off (processes keep running)."""
        _ip("link", "set", self.veth, "up" if up else "down")


class TestHosts:
    """``count`` hosts on one bridge (see the module docstring). ``network``: which of a
    process's sets of hosts this is, when it makes several at once."""

    def __init__(self, count: int, log_dir: Path, network: int = 0) -> None:
        tag = f"lm{os.getpid() % 10000}{'abcdefgh'[network]}"
        subnet = 10 + (os.getpid() * 8 + network) % 200  # unlikely to clash with another run
        self.bridge = f"{tag}br"
        self.gateway_address = f"10.{subnet}.0.254"
        self.hosts = [
            Host(
                name=chr(ord("a") + i),
                netns=f"{tag}-{chr(ord('a') + i)}",
                veth=f"{tag}v{i}",
                address=f"10.{subnet}.0.{i + 1}",
                log_dir=log_dir / chr(ord("a") + i),
            )
            for i in range(count)
        ]

    def __enter__(self) -> list[Host]:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                _ip("netns", "add", host.netns)
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
                    "netns", host.netns)  # fmt: skip
                _ip("link", "set", host.veth, "master", self.bridge)
                _ip("link", "set", host.veth, "up")
                inside = ("-n", host.netns)
                _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip(*inside, "link", "set", "eth0", "up")
                _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            host.kill()
        for host in self.hosts:
            host.wait_empty(10)
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
