"""`lamina up` as a user runs it: Ctrl-C in the terminal sends SIGINT to the whole
foreground process group at once (launcher, services and nats-server alike); everything
must still drain over the bus and exit cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lamina.libs.bus import NatsConfig
from lamina.libs.nats_server import free_port


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_ctrl_c_stops_the_whole_stack_cleanly(tiny_model, tmp_path):
    port, metrics_port, nats_port = free_port(), free_port(), free_port()
    command = [sys.executable, "-c", "from lamina.services.cli import main; main()", "up"]
    options = ["--model", str(tiny_model), "--http-port", str(port), "--nats-port", str(nats_port)]
    # Engine settings are lamina up flags too, and reach the worker.
    options += ["--model-name", "story", "--max-model-len", "200", "--num-kv-blocks", "40"]
    proc = subprocess.Popen(
        [*command, *options, "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a process group of its own, like a terminal's job
        env={**os.environ, "LAMINA_HOME": str(tmp_path)},
    )
    try:
        # Ready when the launcher says so (it prints its URLs after its own readiness
        # checks; the gateway's /ready alone can answer before the launcher has printed).
        started = b""
        deadline = time.monotonic() + 120
        while b"Ctrl-C stops everything." not in started:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
                raise AssertionError(f"the stack never became ready: {started!r}")
            chunk = os.read(proc.stdout.fileno(), 65536)  # unbuffered: select stays true
            if not chunk:
                raise AssertionError(f"the launcher exited during start-up: {started!r}")
            started += chunk
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            assert r.status == 200
        assert [m["id"] for m in get_json(f"http://127.0.0.1:{port}/v1/models")["data"]] == [
            "story"
        ]
        cluster_url = f"http://127.0.0.1:{metrics_port}/v1/cluster"
        heard_by = time.monotonic() + 10  # telemetry hears heartbeats on its own schedule
        while not (workers := get_json(cluster_url)["workers"]) and time.monotonic() < heard_by:
            time.sleep(0.1)
        (worker,) = workers
        assert (worker["model"], worker["max_model_len"]) == ("story", 200)
        assert worker["total_kv_blocks"] == 40
        the_machines_other_commands_find_the_stack(tmp_path, nats_port)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (started + rest).decode(errors="replace")
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    for service in ("gateway", "engine-worker", "scheduler", "telemetry"):
        assert f"{service} stopped" in text, text
    # The URLs it printed once ready.
    assert f"OpenAI API   http://127.0.0.1:{port}/v1" in text, text
    assert f"metrics      http://127.0.0.1:{metrics_port}/metrics" in text, text
    assert f"NATS         nats://127.0.0.1:{nats_port}" in text, text
    assert not (tmp_path / "up.json").exists()  # a stopped stack is not found


def the_machines_other_commands_find_the_stack(home: Path, nats_port: int) -> None:
    """``lamina ctl`` reaches the running stack's bus without being told where, and a
    credential ``lamina creds add`` makes is admitted at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_NATS")}
    env["LAMINA_HOME"] = str(home)

    def lamina(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", "from lamina.services.cli import main; main()", *args],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert "worker-0" in lamina("ctl", "status")
    assert "worker-0: ok (now cordoned)" in lamina("ctl", "cordon", "worker-0")
    assert "worker-0: ok (now ready)" in lamina("ctl", "uncordon", "--all", "--timeout", "10")
    added = lamina("creds", "add", "api.newcomer")
    assert "reloaded" in added, added

    async def connect() -> None:
        config = NatsConfig(f"nats://127.0.0.1:{nats_port}", str(home / "nats" / "api.newcomer.nk"))
        bus = await config.connect("newcomer")
        await bus.close()

    asyncio.run(asyncio.wait_for(connect(), 20))
    # The README's NATS example, as a reader would paste it.
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    example = readme.split("```python\nimport asyncio, json, os, nats\n", 1)[1].split("```")[0]
    done = subprocess.run(
        [sys.executable, "-c", "import asyncio, json, os, nats\n" + example],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "ApiFinished" in done.stdout, done.stdout + done.stderr


def up(*args: str, home: Path) -> subprocess.CompletedProcess:
    program = "import sys; from lamina.services.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", program, "up"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LAMINA_HOME": str(home)},
    )


def test_lamina_up_refuses_plainly_before_starting_anything(tiny_model, tmp_path):
    """A taken port or a model that cannot be served is one line and a non-zero exit,
    before any process is spawned."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = up("--model", str(tiny_model), "--http-port", str(port), home=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"lamina up: port {port} on 127.0.0.1 is in use (--http-port)"

    missing = up("--model", str(tmp_path / "nowhere"), home=tmp_path)
    assert missing.returncode == 2 and "does not exist (--model)" in missing.stderr

    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(tiny_model / "config.json", weightless / "config.json")
    result = up("--model", str(weightless), home=tmp_path)
    assert result.returncode == 2 and "has no *.safetensors weights" in result.stderr

    alien = tmp_path / "alien"
    shutil.copytree(tiny_model, alien)
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2Model"]}))
    unsupported = up("--model", str(alien), home=tmp_path)
    assert unsupported.returncode == 2 and "'GPT2Model'] is not supported" in unsupported.stderr
    half_tls = up("--model", str(tiny_model), "--nats-tls-cert", str(alien), home=tmp_path)
    assert half_tls.returncode == 2 and "go together" in half_tls.stderr
    for refused in (missing, result, unsupported, half_tls):
        assert len(refused.stderr.splitlines()) == 1, refused.stderr  # one line, no traceback
