"""Speculative decoding by prompt lookup (``--speculative-config``) against none, in
process, on a trained checkpoint (``stories260K``: its acceptance is a real model's).

Two workloads, greedy, ``--max-tokens`` tokens each with EOS ignored:

* ``stories``: short story openings; whatever repeats in what the model writes is all
  that prompt lookup can find.
* ``repetitive``: each prompt holds a story the model wrote, then that story's opening
  again: the model retells it, as in editing or quoting (lookup's best case).

For each workload and batch size (``--batch-sizes``), each run times both engines on the
same requests, alternating which goes first, and reports output tokens/s (batch 1:
its inverse is the TPOT), the acceptance rate (accepted / proposed draft tokens) and the
tokens a drafted request made per step. Prints the medians of ``--runs`` and the
speed-up (the median of each run's own ratio). Not a test: run it by hand.

    .venv/bin/python -u benchmarks/speculative.py [--runs 5] [--model DIR]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.speculative import SpeculativeConfig

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "stories260K"
OPENINGS = [[1, 400, 261, 403], [1, 306, 323, 283, 272, 260, 389], [1, 73, 87, 316]]


def engine(model: Path, speculative: SpeculativeConfig | None, max_model_len: int) -> Engine:
    return Engine(
        EngineConfig(model=model, max_model_len=max_model_len, speculative_config=speculative)
    )


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Seconds to run ``prompts`` to their end, and the tokens they made."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    started, made = time.perf_counter(), 0
    while engine.has_work():
        made += sum(len(out.new_token_ids) for out in engine.step().outputs)
    return time.perf_counter() - started, made


def workloads(model: Path, max_model_len: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """Openings for ``stories`` (more by varying the second token), and for
    ``repetitive`` each opening's own greedy story followed by that opening again."""
    openings = [[o[0], o[1] + shift, *o[2:]] for shift in range(0, 40, 4) for o in OPENINGS]
    plain = engine(model, None, max_model_len)
    story_len = max_model_len - max_tokens - 16
    stories = []
    for opening in openings:
        plain.add_request("story", opening, SamplingParams(max_tokens=story_len, temperature=0))
        told: list[int] = []
        while plain.has_work():
            told += [t for out in plain.step().outputs for t in out.new_token_ids]
        stories.append(opening + told + opening)
    return {"stories": openings, "repetitive": stories}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=FIXTURE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ngram = SpeculativeConfig(
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
    )
    max_model_len = 512
    print(f"{platform.node()} {args.model.name} threads={args.threads} {ngram}")
    for name, prompts in workloads(args.model, max_model_len, args.max_tokens).items():
        for batch in args.batch_sizes:
            work = [prompts[i % len(prompts)] for i in range(batch)]
            rates: dict[str, list[float]] = {"none": [], "ngram": []}
            ratios, acceptance, per_step = [], [], []
            for run in range(args.runs):
                engines = {"none": engine(args.model, None, max_model_len)}
                engines["ngram"] = engine(args.model, ngram, max_model_len)
                for e in engines.values():  # warm: the first steps build caches
                    generate(e, work[:1], 8)
                order = ["none", "ngram"] if run % 2 == 0 else ["ngram", "none"]
                for label in order:
                    seconds, made = generate(engines[label], work, args.max_tokens)
                    rates[label].append(made / seconds)
                ratios.append(rates["ngram"][-1] / rates["none"][-1])
                stats = engines["ngram"].stats()
                proposed = stats.spec_decode_num_draft_tokens
                acceptance.append(stats.spec_decode_num_accepted_tokens / max(proposed, 1))
                drafts = max(stats.spec_decode_num_drafts, 1)
                per_step.append(1 + stats.spec_decode_num_accepted_tokens / drafts)
            none, spec = statistics.median(rates["none"]), statistics.median(rates["ngram"])
            print(
                f"{name:10} batch {batch:3}: none {none:8.1f} tok/s, ngram {spec:8.1f} tok/s "
                f"(x{statistics.median(ratios):.2f}, runs {min(ratios):.2f}-{max(ratios):.2f}); "
                f"accepted {statistics.median(acceptance):.0%} of draft tokens, "
                f"{statistics.median(per_step):.2f} tokens per drafted step"
                + (f"; TPOT {1000 / none:.2f} -> {1000 / spec:.2f} ms" if batch == 1 else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
