"""Batch-1 decode against llama.cpp on the same weights, in one run: TPOT and tokens/s of
Lamina's engine in process and of the whole stack over HTTP, against llama.cpp in process
(``llama-cpp-python``), fp32 against llama.cpp's f32, bf16 weights (``--quantization
bf16``) and a bf16 model (``--dtype bfloat16``, bf16 activations, on a CPU with a bf16
matmul) against its BF16, and int8 (``--quantization int8``) against its Q8_0.

The GGUF files are written from the same checkpoint by llama.cpp's own converter
(``convert_hf_to_gguf.py``, from the ``llama-cpp-python`` source distribution of the
installed version, fetched once from the package index into ``$LAMINA_HOME``). Every
side is fed token ids, so the converter's check that it knows the tokenizer's
pre-tokenizer is answered with ``gpt-2`` (the default model's tokenizer is Lamina's own;
the vocabulary is written, the weights are converted as llama.cpp converts them). Both
decode greedily with the same thread count (torch's); each measures the gaps between
consecutive tokens of one 32-token prompt's 129-token answer, after a warm-up. Q8_0 is
not the same arithmetic as Lamina's int8: llama.cpp also quantizes the activations to 8
bits per 32 values and multiplies in integers, while Lamina keeps them in fp32 and
widens the weights (weight-only, exact against the dequantized model).

Needs the ``bench`` extra (``pip install -e '.[bench]'``: builds llama.cpp from source,
minutes on two cores). On a CPU with AMX, llama.cpp's native build crashes in its AMX
Q8_0 matmul; there, reinstall it (``pip install --no-cache-dir --force-reinstall
--no-deps llama-cpp-python==0.3.36``) with ``CMAKE_ARGS`` set to ``-DGGML_NATIVE=OFF
-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF``. Not a test: run it by hand.

During the stack's runs it also reads each process's CPU (``/proc``, as ``data_path.py``
does) and prints it per streamed token: on a host whose cores the engine's threads fill,
every microsecond the gateway, the bus, the worker's event loop and the client take is
taken from a thread of the step's parallel regions, and adds to the TPOT one for one.
``--threads`` runs both engines (in process and the worker's) on that many threads, so
that the rest of the cores are left to the serving processes; ``--without-llamacpp``
compares the engine and the stack alone (no GGUF, no ``llama-cpp-python``).

    .venv/bin/python benchmarks/engine_vs_llamacpp.py --runs 3
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --runs 3 --stream-interval 4
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --runs 5 --without-llamacpp \
        --only int8 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

import msgspec
import torch
from data_path import cpu_of

from lamina.kernels.cpu import bf16_linear
from lamina.libs.config import lamina_home
from lamina.libs.nats_server import free_port
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.launcher import Stack

PROMPT = list(range(5, 37))
TOKENS = 129
PAIRS = (
    ("fp32", "f32", None, "float32"),
    ("bf16", "bf16", "bf16", "float32"),
    ("bf16a", "bf16", None, "bfloat16"),
    ("int8", "q8_0", "int8", "float32"),
)
"""(Lamina's side's name, llama.cpp's GGUF type, Lamina's ``--quantization`` and
``--dtype``) compared with each other. In bf16 both round the same fp32 weights to
nearest (ties to even); llama.cpp also rounds the activations to bf16 for its dot
products; Lamina keeps them in fp32 with bf16 weights (``bf16``) and rounds them as torch's
bf16 ops do in a bf16 model (``bf16a``, run only where the CPU has a bf16 matmul)."""


def converter() -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` of the installed ``llama-cpp-python``, with
    the ``gguf-py`` it imports."""
    version = metadata.version("llama-cpp-python")
    root = lamina_home() / "llama.cpp" / version
    script = root / "convert_hf_to_gguf.py"
    if (root / "gguf-py").exists():
        return script
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "-d", download, f"llama-cpp-python=={version}"],
            check=True, capture_output=True,
        )  # fmt: skip
        (sdist,) = Path(download).glob("*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.name.startswith(prefix)
                and (
                    m.name.endswith("convert_hf_to_gguf.py")
                    or "/conversion/" in m.name
                    or "/gguf-py/" in m.name  # the converter's own gguf package
                )
            ]
            for member in members:
                member.name = member.name.removeprefix(prefix)
            archive.extractall(root, members=members, filter="data")
    return script


def to_gguf(model: Path, outtype: str, target: Path) -> Path:
    """``model`` converted by llama.cpp's converter to ``outtype`` (f32, q8_0)."""
    if target.exists():
        return target
    script = converter()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[1:]\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "import convert_hf_to_gguf; convert_hf_to_gguf.main()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(script.parent), str(model),
         "--outtype", outtype, "--outfile", str(target)],
        check=True, capture_output=True,
    )  # fmt: skip
    return target


def llamacpp_gaps(gguf: Path, threads: int) -> list[float]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip
    stamps = []
    for _ in llm.generate(PROMPT, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == TOKENS:
            break
    return _gaps(stamps)


def engine_gaps(engine: Engine) -> list[float]:
    engine.add_request(
        "b1", PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    )
    stamps = []
    while engine.has_work():
        if engine.step().outputs:
            stamps.append(time.perf_counter())
    return _gaps(stamps)


async def stack_gaps(host: str, port: int, interval: int = 1) -> list[float]:
    """One streamed completion over HTTP/1.1 (a minimal client: it shares the cores with
    the stack): the gaps between its tokens, from the times of their chunks. With a
    worker's ``--stream-interval`` a chunk after the first carries ``interval`` tokens, so
    each gap between chunks counts as ``interval`` gaps of its ``1 / interval``."""
    body = msgspec.json.encode(
        {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
         "stream": True}
    )  # fmt: skip
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200", head
    stamps, pending = [], b""
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        pending += (await reader.readexactly(size + 2))[:-2]
        *events, pending = pending.split(b"\n\n")
        now = time.perf_counter()
        stamps += [now for e in events if e.startswith(b"data: {") and b'"text":""' not in e]
    writer.close()
    return [gap / interval for gap in _gaps(stamps) for _ in range(interval)]


def _gaps(stamps: list[float]) -> list[float]:
    """The gaps between tokens after the first (which is the prompt's prefill)."""
    return [b - a for a, b in itertools.pairwise(stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: the 'small' preset)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the worker's (tokens a chunk)"
    )
    parser.add_argument(
        "--threads", type=int, help="each engine's threads (default: torch's, all cores)"
    )
    parser.add_argument(
        "--without-llamacpp", action="store_true", help="the engine and the stack only"
    )
    parser.add_argument(
        "--only", nargs="+", choices=[pair[0] for pair in PAIRS], help="these rows only"
    )
    args = parser.parse_args()
    model = args.model or ensure_default_model("small")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    gguf_dir = lamina_home() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {model.name}; batch 1, {len(PROMPT)}-token prompt, {TOKENS} tokens, "
          f"{threads} threads; medians of {args.runs} runs of each side")  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    for ours, outtype, quantization, dtype in PAIRS:
        if args.only and ours not in args.only:
            continue
        if dtype == "bfloat16" and not bf16_linear.available():
            print(f"{ours:>5}: skipped (this CPU has no bf16 matmul)")
            continue
        gguf = None
        if not args.without_llamacpp:
            gguf = to_gguf(model, outtype, gguf_dir / f"{model.name}-{outtype}.gguf")
        config = EngineConfig(
            model=model,
            quantization=quantization,
            dtype=dtype,
            max_model_len=512,
            num_kv_blocks=64,
        )
        engine = Engine(config)
        engine_gaps(engine)  # warm-up
        worker_args = ["--max-model-len", "512", "--num-kv-blocks", "64", "--dtype", dtype]
        worker_args += ["--stream-interval", str(args.stream_interval)]
        if quantization:
            worker_args += ["--quantization", quantization]
        with (
            tempfile.TemporaryDirectory() as logs,
            Stack(
                model=model,
                http_port=free_port(),
                metrics_port=free_port(),
                log_dir=Path(logs),
                credentials=Path(logs) / "nats",
                worker_args=worker_args,
                extra_env={"OMP_NUM_THREADS": str(threads)},
            ) as stack,
        ):
            pids = {name: proc.pid for name, proc in stack.procs.items()}
            if stack.nats is not None:
                pids["nats-server"] = stack.nats.pid
            interval = args.stream_interval
            asyncio.run(stack_gaps(stack.http_host, stack.http_port, interval))  # warm-up
            sides: dict[str, list[float]] = {"engine": [], "stack": []}
            if gguf is not None:
                sides["llama.cpp"] = []
            cpu: Counter[str] = Counter()
            for _ in range(args.runs):  # interleaved, so drift falls on every side alike
                if gguf is not None:
                    sides["llama.cpp"].append(statistics.median(llamacpp_gaps(gguf, threads)))
                sides["engine"].append(statistics.median(engine_gaps(engine)))
                time.sleep(0.05)  # this process's OpenMP threads stop spinning: not the client's
                before = cpu_of(pids)
                gaps = asyncio.run(stack_gaps(stack.http_host, stack.http_port, interval))
                cpu.update({k: v - before[k] for k, v in cpu_of(pids).items()})
                sides["stack"].append(statistics.median(gaps))
        del engine
        results[ours] = {side: statistics.median(v) * 1e3 for side, v in sides.items()}
        spread = {side: f"{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}" for side, v in sides.items()}
        row = results[ours]
        peer = f" vs llama.cpp {outtype}" if gguf else ""
        print(f"{ours:>5}{peer}: TPOT ms (range) " + ", ".join(
            f"{side} {row[side]:.2f} ({spread[side]})" for side in sides
        ))  # fmt: skip
        print(f"       stack / engine {row['stack'] / row['engine']:.2f}" + (
            f", stack / llama.cpp {row['stack'] / row['llama.cpp']:.2f}, "
            f"engine / llama.cpp {row['engine'] / row['llama.cpp']:.2f}" if gguf else ""
        ))  # fmt: skip
        streamed = args.runs * (TOKENS - 1)
        print("       CPU µs a streamed token: " + ", ".join(
            f"{name} {seconds / streamed * 1e6:.0f}" for name, seconds in cpu.items()
        ))  # fmt: skip
    fp32 = results.get("fp32")
    for ours, theirs in (("bf16", "BF16"), ("bf16a", "BF16"), ("int8", "Q8_0")):
        if ours not in results or fp32 is None:
            continue
        row = results[ours]
        peer = (
            f" (llama.cpp {theirs} over f32: {fp32['llama.cpp'] / row['llama.cpp']:.2f}x)"
            if "llama.cpp" in row
            else ""
        )
        print(
            f"{ours} tokens/s over fp32: engine {fp32['engine'] / row['engine']:.2f}x, "
            f"stack {fp32['stack'] / row['stack']:.2f}x{peer}"
        )


if __name__ == "__main__":
    main()
