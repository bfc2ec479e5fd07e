"""What constrained decoding costs: JSON-schema-constrained requests vs the same requests
unconstrained, at batch 1 and batch 32, on the ``small`` model, in one run.

Each constrained run records every request's output length; its unconstrained twin asks
for exactly those lengths (``ignore_eos``), so both sides run the same batches for the
same number of steps and differ only by the grammar work: the mask computed for every
constrained row, applied to the logits, and each matcher advanced. Prints the medians of
``--runs`` runs, the throughput ratio, the time added per step, and grammar compile times
(a cold compile per schema, and a cached one).

``--engines`` also measures the two grammar engines on the same vocabulary and schemas:
llguidance (what Lamina uses) and xgrammar (vLLM's default): compile time, and the time
to fill one constrained row's mask and a batch of 32 rows. Not a test: run it by hand.

    .venv/bin/python benchmarks/structured.py
    .venv/bin/python benchmarks/structured.py --engines
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from pathlib import Path

from lamina.schemas.v1.generate import Sampling, StructuredOutput
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.default_model import ensure_default_model
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.grammar import GrammarCompiler

WORD = {"type": "string", "maxLength": 16}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": WORD,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": WORD, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": WORD, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "status": {"enum": ["active", "suspended", "closed"]},
    },
    "required": ["name", "age", "tags", "address", "status"],
}
"""The throughput workload's schema: what an extraction request typically asks for."""

COMPILE_SCHEMAS = [
    {"type": "integer"},
    {"enum": ["a", "b", "c"]},
    {"type": "object", "properties": {"a": WORD}, "required": ["a"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 8},
    SCHEMA,
    {
        "type": "object",
        "$defs": {"node": {"type": "object", "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        }}},
        "properties": {"root": {"$ref": "#/$defs/node"}},
        "required": ["root"],
    },
    {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "null"]}
                                      for i in range(40)}},
]  # fmt: skip
"""Schemas of increasing size for the compile times."""


def run(
    engine: Engine, prompts: list[list[int]], params: list[Sampling]
) -> tuple[float, int, list[int]]:
    """Run the requests together: (seconds, engine steps, each request's output length)."""
    engine.reset_prefix_cache()
    compiler = _compiler(engine)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        # As the worker does: the wire's sampling converted, its constraint compiled.
        grammar = wire.constraint(compiler, p.structured) if p.structured else None
        engine.add_request(f"r{i}", prompt, wire.sampling_params(p), grammar=grammar)
    lengths = [0] * len(prompts)
    steps = 0
    started = time.perf_counter()
    while engine.has_work():
        steps += 1
        for out in engine.step().outputs:
            lengths[int(out.request_id[1:])] += len(out.new_token_ids)
    return time.perf_counter() - started, steps, lengths


@functools.cache
def _compiler(engine: Engine) -> GrammarCompiler:
    return engine.spec.grammar_compiler()


def compare(engine: Engine, batch: int, runs: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(batch)]
    spec = StructuredOutput(json=json.dumps(SCHEMA))
    constrained = [
        Sampling(max_tokens=400, temperature=1.0, seed=seed + i, structured=spec)
        for i in range(batch)
    ]
    run(engine, prompts, constrained)  # warm-up (and the grammar compiled, cached)
    ours, theirs, added = [], [], []
    for _ in range(runs):
        t_c, steps, lengths = run(engine, prompts, constrained)
        plain = [
            Sampling(max_tokens=n, temperature=1.0, seed=seed + i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        t_u, steps_u, lengths_u = run(engine, prompts, plain)
        assert lengths_u == lengths and steps_u == steps, (lengths, lengths_u)
        tokens = sum(lengths)
        ours.append(tokens / t_c)
        theirs.append(tokens / t_u)
        added.append((t_c - t_u) / steps * 1e3)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(
        f"batch {batch:>2}: constrained {a:7.1f} tok/s vs unconstrained {b:7.1f} tok/s -> "
        f"ratio {a / b:.3f} ({(1 - a / b) * 100:+.1f}% loss); added per step "
        f"{statistics.median(added):+.3f} ms (runs {', '.join(f'{x:+.3f}' for x in added)}); "
        f"{sum(lengths)} tokens in {steps} steps"
    )


def compile_times(model: Path, vocab: int, eos: tuple[int, ...]) -> None:
    for i, schema in enumerate(COMPILE_SCHEMAS):
        spec = StructuredOutput(json=json.dumps(schema))
        cold = []
        for _ in range(5):
            compiler = GrammarCompiler(model, vocab, eos)
            wire.constraint(compiler, StructuredOutput(json="true"))  # the vocabulary
            started = time.perf_counter()
            wire.constraint(compiler, spec)  # what the worker does with a request's
            cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        wire.constraint(compiler, spec)
        cached = time.perf_counter() - started
        print(
            f"  schema {i} ({len(json.dumps(schema))} chars): compile "
            f"{statistics.median(cold) * 1e3:.2f} ms (median of 5), cached {cached * 1e6:.0f} us"
        )


def engines(model: Path, vocab: int, eos: tuple[int, ...]) -> None:
    """llguidance vs xgrammar: compile, one row's mask, a 32-row batch's masks."""
    import llguidance
    import llguidance.torch as llt
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tokenizer_json = (model / "tokenizer.json").read_text()
    ll_vocab = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(eos))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(eos))
    rng = random.Random(0)
    rows = 32

    def walk(allowed_next, accept, done, steps: int) -> list[float]:
        """Per-token mask times along a random path through the grammar."""
        times = []
        for _ in range(steps):
            if done():
                break
            started = time.perf_counter()
            allowed = allowed_next()
            times.append(time.perf_counter() - started)
            if not allowed:
                break
            accept(rng.choice(allowed))
        return times

    for i, schema in enumerate(COMPILE_SCHEMAS):
        text = json.dumps(schema)
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_vocab, llguidance.grammar_from("json_schema", text))
        ll_compile = time.perf_counter() - started
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(text)
        xg_compile = time.perf_counter() - started

        ll_mask = llt.allocate_token_bitmask(1, vocab)

        def ll_allowed(m=matcher, mask=ll_mask) -> list[int]:
            llt.fill_next_token_bitmask(m, mask, 0)
            return _allowed(mask[0], vocab, torch)

        ll_times = walk(ll_allowed, matcher.consume_token, matcher.is_stopped, 100)
        xg_matcher = xgr.GrammarMatcher(compiled)
        xg_mask = xgr.allocate_token_bitmask(1, vocab)

        def xg_allowed(m=xg_matcher, mask=xg_mask) -> list[int]:
            m.fill_next_token_bitmask(mask, 0)
            return _allowed(mask[0], vocab, torch)

        xg_times = walk(xg_allowed, xg_matcher.accept_token, xg_matcher.is_terminated, 100)
        # A batch: 32 fresh matchers, all masks filled for one step.
        proto = llguidance.LLMatcher(ll_vocab, llguidance.grammar_from("json_schema", text))
        ll_batch = [proto.deep_copy() for _ in range(rows)]  # as the engine makes them
        bitmask = llt.allocate_token_bitmask(rows, vocab)
        executor = llguidance.LLExecutor()
        started = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, [(m, r) for r, m in enumerate(ll_batch)], bitmask)
        ll_step = time.perf_counter() - started
        xg_batch = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        xg_bitmask = xgr.allocate_token_bitmask(rows, vocab)
        started = time.perf_counter()
        for r, m in enumerate(xg_batch):
            m.fill_next_token_bitmask(xg_bitmask, r)
        xg_step = time.perf_counter() - started
        print(
            f"  schema {i}: compile llguidance {ll_compile * 1e3:.2f} ms, xgrammar "
            f"{xg_compile * 1e3:.2f} ms; one row's mask (median over a random path) "
            f"llguidance {_us(ll_times)}, xgrammar {_us(xg_times)}; a {rows}-row batch's "
            f"first masks llguidance {ll_step * 1e6:.0f} us, xgrammar {xg_step * 1e6:.0f} us"
        )


def _allowed(row, vocab: int, torch) -> list[int]:
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return torch.nonzero(bits).flatten().tolist()


def _us(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e6:.1f} us" if times else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: the 'small' preset)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--engines", action="store_true", help="also llguidance vs xgrammar")
    args = parser.parse_args()
    model = args.model or ensure_default_model("small")
    engine = Engine(EngineConfig(model=model, max_model_len=1024, kv_cache_memory_bytes=256 << 20))
    mc = engine.model_config
    print(f"model {model.name} (vocab {mc.vocab_size}); schema of {len(json.dumps(SCHEMA))} chars")
    for batch in args.batches:
        compare(engine, batch, args.runs, seed=batch)
    print("grammar compile (llguidance, this model's vocabulary):")
    compile_times(model, mc.vocab_size, mc.eos_token_ids)
    if args.engines:
        print("grammar engines:")
        engines(model, mc.vocab_size, mc.eos_token_ids)


if __name__ == "__main__":
    main()
