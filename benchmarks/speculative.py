"""Speculative decoding (``--speculative-config``) by prompt lookup and by a draft model
against none, in process, on a trained checkpoint (``stories260K``: its acceptance is a
real model's). The draft model is ``--draft-model``, or by default the target's first
``--draft-layers`` layers saved as a checkpoint of their own (no smaller model trained on
the same data is at hand here).

Two workloads, greedy, ``--max-tokens`` tokens each with EOS ignored:

* ``stories``: short story openings; whatever repeats in what the model writes is all
  that prompt lookup can find.
* ``repetitive``: each prompt holds a story the model wrote, then that story's opening
  again: the model retells it, as in editing or quoting (lookup's best case).

For each workload and batch size (``--batch-sizes``), each run times the engines
(``--methods``; each also as ``<method>-adaptive``, with ``"adaptive": true``: drafting
only where the engine's gate finds it pays) on the same requests, rotating which goes
first, and reports output tokens/s (batch 1: its inverse is the TPOT), the acceptance
rate (accepted / proposed draft tokens) and the tokens a drafted request made per step.
Prints the medians of ``--runs`` and the speed-up (the median of each run's own ratio).

``--llamacpp`` adds the peer at batch 1: llama.cpp (``llama-cpp-python``, the ``bench``
extra) on the same weights converted to an f32 GGUF by llama.cpp's own converter
(``engine_vs_llamacpp.to_gguf``), greedy, without and with its prompt-lookup decoding
(``LlamaPromptLookupDecoding``: ``--num-speculative-tokens`` drafted from n-grams of up
to ``--prompt-lookup-max`` tokens), the same prompt and token count, alternated run by
run. Not a test: run it by hand.

    .venv/bin/python -u benchmarks/speculative.py [--runs 5] [--model DIR]
        [--methods ngram draft_model ngram-adaptive draft_model-adaptive]
        [--draft-model DIR | --draft-layers 1] [--llamacpp]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


def first_layers(model: Path, layers: int, out: Path) -> Path:
    """``model``'s embedding, first ``layers`` layers, norm and head as a checkpoint in
    ``out``."""
    config = json.loads((model / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    layer = re.compile(r"model\.layers\.(\d+)\.")
    weights = {}
    for file in model.glob("*.safetensors"):
        weights |= load_file(file)
    kept = {k: v for k, v in weights.items() if int((layer.match(k) or [0, 0])[1]) < layers}
    save_file(kept, out / "model.safetensors")
    return out


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
    parser.add_argument(
        "--methods", nargs="+", default=["ngram", "draft_model"], help="-adaptive: with the gate"
    )
    parser.add_argument("--draft-model", type=Path, help="default: the target's first layers")
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--llamacpp", action="store_true", help="the llama.cpp peer at batch 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="lamina-draft-") as scratch:
        draft = args.draft_model or first_layers(args.model, args.draft_layers, Path(scratch))
        tokens = args.num_speculative_tokens
        configs = {
            "ngram": SpeculativeConfig(
                num_speculative_tokens=tokens,
                prompt_lookup_max=args.prompt_lookup_max,
                prompt_lookup_min=args.prompt_lookup_min,
            ),
            "draft_model": SpeculativeConfig(
                method="draft_model", model=str(draft), num_speculative_tokens=tokens
            ),
        }
        for name, config in list(configs.items()):  # each with the gate too
            configs[f"{name}-adaptive"] = dataclasses.replace(config, adaptive=True)
        methods = {m: configs[m] for m in args.methods}
        print(f"{platform.node()} {args.model.name} threads={args.threads}")
        for config in methods.values():
            print(f"  {config}")
        compare(args, methods)


def llamacpp_run(llm, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds from ``llm``'s first output token to its ``max_tokens``-th, greedy (the
    first is the prompt's prefill), and the tokens."""
    stamps, tokens = [], []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(stamps) == max_tokens:
            break
    return stamps[-1] - stamps[0], tokens


def bpe_copy(model: Path, out: Path) -> Path:
    """``model`` with its tokenizer as a byte-pair one over the same ids, in ``out``:
    stories260K's is word-level, which llama.cpp's converter writes without the merges its
    loader requires. Both sides are fed token ids, so names do not matter: the last three
    tokens are renamed ``xy``, ``x`` and ``y`` for the one merge ``x y``."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    if tokenizer["model"]["type"] == "BPE":
        return model
    out.mkdir(parents=True, exist_ok=True)
    for file in model.iterdir():
        if file.name != "tokenizer.json":
            (out / file.name).write_bytes(file.read_bytes())
    names = {i: name for name, i in tokenizer["model"]["vocab"].items()}
    last = len(names) - 1
    names |= {last - 2: "xy", last - 1: "x", last: "y"}
    tokenizer["model"] = {
        "type": "BPE",
        "vocab": {name: i for i, name in names.items()},
        "merges": ["x y"],
        "unk_token": None,
        "dropout": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
    }
    tokenizer["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def compare_llamacpp(args: argparse.Namespace, workload: str, prompt: list[int]) -> None:
    """llama.cpp at batch 1 on ``prompt``, without and with prompt-lookup decoding."""
    from engine_vs_llamacpp import to_gguf
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from lamina.libs.config import lamina_home

    gguf_dir = lamina_home() / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    target = gguf_dir / f"{args.model.name}-f32.gguf"
    with tempfile.TemporaryDirectory() as scratch:
        gguf = to_gguf(bpe_copy(args.model, Path(scratch) / args.model.name), "f32", target)
    common = dict(
        model_path=str(gguf), n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads
    )
    lookup = LlamaPromptLookupDecoding(
        max_ngram_size=args.prompt_lookup_max, num_pred_tokens=args.num_speculative_tokens
    )
    sides = {
        "llama.cpp": Llama(**common, verbose=False),
        "llama.cpp + lookup": Llama(**common, draft_model=lookup, verbose=False),
    }
    rates: dict[str, list[float]] = {side: [] for side in sides}
    outputs: dict[str, list[int]] = {}
    for run in range(args.runs):
        for side in list(sides)[run % 2 :] + list(sides)[: run % 2]:
            seconds, outputs[side] = llamacpp_run(sides[side], prompt, args.max_tokens)
            rates[side].append((args.max_tokens - 1) / seconds)
    if len({tuple(tokens) for tokens in outputs.values()}) > 1:  # greedy: it must not change
        print("  llama.cpp's output with prompt lookup differs from its output without")
    ratios = [s / p for s, p in zip(rates["llama.cpp + lookup"], rates["llama.cpp"], strict=True)]
    plain, spec = (statistics.median(rates[side]) for side in sides)
    print(
        f"{workload:10} batch   1: llama.cpp {plain:8.1f} tok/s (TPOT {1000 / plain:.2f} ms); "
        f"with prompt lookup {spec:8.1f} tok/s (x{statistics.median(ratios):.2f}, runs "
        f"{min(ratios):.2f}-{max(ratios):.2f}; TPOT {1000 / spec:.2f} ms)",
        flush=True,
    )


def compare(args: argparse.Namespace, methods: dict[str, SpeculativeConfig]) -> None:
    max_model_len = 512
    for name, prompts in workloads(args.model, max_model_len, args.max_tokens).items():
        if args.llamacpp:
            compare_llamacpp(args, name, prompts[0])
        for batch in args.batch_sizes:
            work = [prompts[i % len(prompts)] for i in range(batch)]
            labels = ["none", *methods]
            rates: dict[str, list[float]] = {label: [] for label in labels}
            ratios: dict[str, list[float]] = {m: [] for m in methods}
            acceptance: dict[str, list[float]] = {m: [] for m in methods}
            per_step: dict[str, list[float]] = {m: [] for m in methods}
            for run in range(args.runs):
                engines = {"none": engine(args.model, None, max_model_len)}
                engines |= {m: engine(args.model, c, max_model_len) for m, c in methods.items()}
                for e in engines.values():  # warm: the first steps build caches
                    generate(e, work[:1], 8)
                for label in labels[run % len(labels) :] + labels[: run % len(labels)]:
                    seconds, made = generate(engines[label], work, args.max_tokens)
                    rates[label].append(made / seconds)
                for m in methods:
                    ratios[m].append(rates[m][-1] / rates["none"][-1])
                    stats = engines[m].stats()
                    proposed = stats.spec_decode_num_draft_tokens
                    acceptance[m].append(stats.spec_decode_num_accepted_tokens / max(proposed, 1))
                    drafts = max(stats.spec_decode_num_drafts, 1)
                    per_step[m].append(1 + stats.spec_decode_num_accepted_tokens / drafts)
            none = statistics.median(rates["none"])
            print(
                f"{name:10} batch {batch:3}: none {none:8.1f} tok/s"
                + (f" (TPOT {1000 / none:.2f} ms)" if batch == 1 else ""),
                flush=True,
            )
            for m in methods:
                spec, r = statistics.median(rates[m]), ratios[m]
                print(
                    f"{'':16}{m:20} {spec:8.1f} tok/s (x{statistics.median(r):.2f}, runs "
                    f"{min(r):.2f}-{max(r):.2f}); accepted {statistics.median(acceptance[m]):.0%} "
                    f"of draft tokens, {statistics.median(per_step[m]):.2f} tokens per drafted "
                    "step" + (f"; TPOT {1000 / spec:.2f} ms" if batch == 1 else ""),
                    flush=True,
                )


if __name__ == "__main__":
    main()
