"""Many LoRA adapters in one batch against the base model alone, in process.

A batch of ``--batch`` requests (``--prompt-len`` random prompt tokens, ``--max-tokens``
output each, greedy, EOS ignored) runs on an engine serving ``k`` adapters (rank
``--rank`` on all seven projections, PEFT files written here with random weights), the
requests spread round-robin over the ``k`` (``--max-loras k``: every adapter in every
step), for each ``k`` of ``--adapters``; the same batch runs on the engine without
adapters (what the merged model would cost: merging changes the weights, not the work).
Each run times every engine on the same requests (its prefix cache emptied first, so that
every run computes its prompts), the order rotated per run. Prints output tokens/s over
the whole batch and over its decode phase, medians of ``--runs``, and each ``k``'s ratio
to the base model (the median of each run's own ratio). Target (issue 43): >= 0.8x at 8
adapters; vLLM's and S-LoRA's published overheads are the anchors. ``--torch-forms``
adds, per ``k``, the same engine with the CPU's native LoRA kernel off (the torch forms on
every step). Not a test: run it by hand.

    .venv/bin/python -u benchmarks/lora.py [--runs 3] [--preset small] [--torch-forms]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.lora import LoraModule, LoraModules, projection_shape
from lamina.services.engine_worker.engine.model_config import ModelConfig
from lamina.services.engine_worker.engine.params import SamplingParams

MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapter(directory: Path, model: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT adapter of ``model`` with random weights, as ``peft`` would save it."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for module, block in MODULES.items():
            fan_in, fan_out = projection_shape(model, module)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[key + ".lora_A.weight"] = a
            tensors[key + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    config["target_modules"] = list(MODULES)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def run(
    engine: Engine, prompts: list[list[int]], adapters: list[str | None], tokens: int
) -> tuple[float, float]:
    """Output tokens per second of the batch, each prompt with its adapter: over the whole
    batch, and over its decode phase (the steps after every request's first token)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()  # every run computes its prompts (each run repeats them)
    stamp = time.monotonic_ns()
    for i, (prompt, lora) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"r{stamp}-{i}", prompt, params, lora=lora)
    started, made = time.perf_counter(), 0
    decoding, decoded = 0.0, 0  # when every request had its first token, tokens since
    while engine.has_work():
        step = sum(len(out.new_token_ids) for out in engine.step().outputs)
        made += step
        if decoding:
            decoded += step
        elif made >= len(prompts):
            decoding = time.perf_counter()
    ended = time.perf_counter()
    return made / (ended - started), decoded / (ended - decoding)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", default="cpu", help="e.g. cuda: the Triton LoRA kernels")
    parser.add_argument("--dtype", default="auto", help="e.g. bfloat16 on a GPU")
    parser.add_argument(
        "--torch-forms", action="store_true", help="also each k without the native kernel"
    )
    args = parser.parse_args()

    model_dir = ensure_default_model(args.preset)
    model = ModelConfig.from_dir(model_dir)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, model.vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.batch)
    ]
    max_len = args.prompt_len + args.max_tokens
    common = dict(model=model_dir, max_model_len=max_len, max_num_seqs=args.batch)
    common |= dict(device=args.device, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as scratch:
        most = max(args.adapters)
        paths = [write_adapter(Path(scratch) / f"a{n}", model, args.rank, n) for n in range(most)]
        engines: dict[str, tuple[Engine, list[str | None]]] = {
            "base": (Engine(EngineConfig(**common)), [None] * args.batch)
        }
        for k in args.adapters:
            modules = LoraModules(tuple(LoraModule(f"a{n}", paths[n]) for n in range(k)))
            config = EngineConfig(
                **common, lora_modules=modules, max_loras=k, max_lora_rank=args.rank
            )
            names: list[str | None] = [f"a{i % k}" for i in range(args.batch)]
            engines[f"{k} adapters"] = (Engine(config), names)
            if args.torch_forms:
                engine = Engine(config)
                engine.runner.lora_slots.kernel_rows = 0  # type: ignore[union-attr]
                engines[f"{k}, torch forms"] = (engine, names)
        for engine, adapters in engines.values():  # warm: kernels built, pages touched
            run(engine, prompts[:2], adapters[:2], 4)
        rates: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for r in range(args.runs):
            order = list(engines)
            order = order[r % len(order) :] + order[: r % len(order)]
            for name in order:
                engine, adapters = engines[name]
                rates[name].append(run(engine, prompts, adapters, args.max_tokens))
    where = args.device if args.device != "cpu" else platform.processor() or platform.machine()
    print(
        f"{args.preset} preset, {where}, {args.dtype}, "
        f"{torch.get_num_threads()} threads; batch {args.batch}, {args.prompt_len} prompt + "
        f"{args.max_tokens} output tokens, rank {args.rank}, medians of {args.runs} runs"
    )
    for phase, label in ((0, "whole batch"), (1, "decode phase")):
        print(f" {label}:")
        base = [rate[phase] for rate in rates["base"]]
        for name, both in rates.items():
            measured = [rate[phase] for rate in both]
            ratio = statistics.median(m / b for m, b in zip(measured, base, strict=True))
            spread = f"{min(measured):,.0f}-{max(measured):,.0f}"
            median = statistics.median(measured)
            print(f"  {name:>16}: {median:8,.0f} tok/s ({spread})  {ratio:.2f}x base")


if __name__ == "__main__":
    main()
