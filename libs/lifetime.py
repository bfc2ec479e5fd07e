"""Child processes that die with their parent, however the parent ends.

A supervisor stops its children when it is told to (``lamina up`` on SIGTERM); one that
is SIGKILLed cannot, and its children (``nats-server`` still holding its port, the
gateway's tokenizer processes) would live on under PID 1. Linux's parent-death signal
(``prctl(PR_SET_PDEATHSIG)``) has the kernel signal the child instead. It is sent when
the *thread* that started the child ends, so children are started from a thread that
lives as long as the parent (the main thread, or the gateway's event loop).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from lamina.libs.config import env_name, process_env

PR_SET_PDEATHSIG = 1
PARENT_ENV = env_name("parent_pid")
"""Set by a supervisor on the services it starts: the child dies with that process."""

# Resolved in the parent: a child between fork and exec must not load a library.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Have the kernel send this process ``sig`` when its parent dies (inherited across
    ``exec``). ``parent``: the pid it was started by; if that one is already gone (it died
    before this was set), ``sig`` is raised now. Safe as a ``Popen`` ``preexec_fn``."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def die_with_supervisor() -> None:
    """:func:`die_with_parent` for a service whose supervisor said so (:data:`PARENT_ENV`)."""
    parent = process_env().parent_pid
    if parent:
        die_with_parent(signal.SIGTERM, parent)


def orphaned() -> bool:
    """Whether the supervisor this service was started by (:data:`PARENT_ENV`) is gone:
    then its bus most likely went with it, and nothing is left to drain to."""
    parent = process_env().parent_pid
    return bool(parent) and os.getppid() != parent
