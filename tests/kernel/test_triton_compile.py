"""Every Triton kernel compiles for sm_90 (H100/H200) to a cubin on this CPU-only machine.

The interpreter that the other kernel tests use runs kernels as Python and accepts what GPU
compilation refuses (a kernel reading a plain float global, a dtype ``tl.dot`` cannot
take); this catches that before a GPU session has to. See ``sm90_compile.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_every_kernel_compiles_for_sm90():
    from tests.kernel.sm90_compile import cases

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernel.sm90_compile"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    compiled = {line[3:] for line in run.stdout.splitlines() if line.startswith("ok ")}
    assert compiled == {name for name, *_ in cases()}
