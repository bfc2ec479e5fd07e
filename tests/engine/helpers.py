"""Drive the engine or its model runner directly in tests."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.params import SamplingParams
from lamina.services.engine_worker.engine.request import Request


def make_engine(model, **overrides) -> Engine:
    config = dict(model=model, max_model_len=256, num_kv_blocks=128, block_size=16)
    return Engine(EngineConfig(**(config | overrides)))


def run_to_completion(
    engine: Engine, prompts: dict[str, list[int]], params: SamplingParams, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """Add all ``prompts`` at once, step until done, return each request's output tokens."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return drain(engine, max_steps)


def drain(engine: Engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def greedy_by_backend(
    model, monkeypatch, backends: tuple[str, ...], max_tokens: int = 6, **overrides
) -> dict[str, dict[str, list[int]]]:
    """The same mixed batch (chunked prefill, then decodes) run greedily on each kernel
    backend (``LAMINA_KERNELS``): each backend's outputs by request."""
    prompts = {"a": list(range(40, 61)), "b": [7, 8, 9], "c": list(range(100, 140))}
    outputs = {}
    for backend in backends:
        monkeypatch.setenv("LAMINA_KERNELS", backend)
        engine = make_engine(model, max_num_batched_tokens=32, **overrides)
        assert engine.runner.model.ops.backend == backend
        outputs[backend] = run_to_completion(engine, prompts, greedy(max_tokens))
    return outputs


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def teacher_forced_logits(
    engine: Engine, sequences: list[list[int]], prompt_lens: list[int]
) -> list[torch.Tensor]:
    """Prefill each sequence's prompt together in one step, then feed the rest of each
    sequence one token per step (all sequences in the same batch), as decoding would with
    the sequence's own next token in place of the sampled one. Returns, per sequence,
    logits ``(len - prompt_len + 1, vocab)`` for positions ``prompt_len - 1`` onwards."""
    blocks = engine.blocks
    requests = []
    for n, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        request = Request(f"tf{n}", seq[:p], SamplingParams(), max_tokens=len(seq))
        assert blocks.allocate(request, len(seq)) is not None
        requests.append(request)
    collected: list[list[torch.Tensor]] = [[] for _ in sequences]
    while True:
        # Decodes first, as the scheduler orders a batch.
        live = sorted(
            (r for r in requests if r.num_computed_tokens < len(sequences[requests.index(r)])),
            key=lambda r: r.num_tokens - r.num_computed_tokens != 1,
        )
        if not live:
            break
        num_new = [r.num_tokens - r.num_computed_tokens for r in live]
        batch = ScheduledBatch(
            requests=live,
            num_new_tokens=num_new,
            block_tables=[blocks.block_table(r) for r in live],
            num_decodes=num_new.count(1),
        )
        logits = engine.forward(batch)  # every request finishes its tokens
        for row, request in enumerate(live):
            i = requests.index(request)
            collected[i].append(logits[row].clone())  # a CUDA graph's buffer is reused
            request.num_computed_tokens = request.num_tokens
            if request.num_tokens < len(sequences[i]):
                request.token_ids.append(sequences[i][request.num_tokens])
    for request in requests:
        blocks.free_request(request)
    return [torch.stack(rows) for rows in collected]


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``transformers``' greedy continuation of ``prompt`` (no end-of-sequence stop)."""
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection an adapter may target."""


def make_adapter(stories, path, rank, alpha, targets, seed):
    """A PEFT adapter of ``stories`` saved by ``peft`` itself, its weights random (a
    trained adapter's are not zero either); returns the merged ``transformers`` model."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(stories)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # peft's random B swamps this small model: changed, not drowned
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.2)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def variant(stories: Path, out: Path, layers: int = 5, **config) -> Path:
    """stories260K's first ``layers`` layers as a checkpoint of its own in ``out``, with
    ``config`` changed."""
    given = json.loads((stories / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(given | config | {"num_hidden_layers": layers}))
    weights = load_file(stories / "model.safetensors")
    layer = re.compile(r"model\.layers\.(\d+)\.")
    kept = {k: v for k, v in weights.items() if int((layer.match(k) or [0, 0])[1]) < layers}
    vocab = config.get("vocab_size", given["vocab_size"])
    kept["model.embed_tokens.weight"] = kept["model.embed_tokens.weight"][:vocab].clone()
    save_file(kept, out / "model.safetensors")
    return out


def saved_in(source: Path, target: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``source`` (a checkpoint) at ``target`` with its weights saved in ``dtype``, and its
    ``config.json`` saying so (what ``dtype="auto"`` reads)."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in tensors.items()}, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config.pop("dtype", None)  # newer writers' name for it, read first
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config))
    return target
