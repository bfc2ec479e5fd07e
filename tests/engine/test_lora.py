"""LoRA adapters in the engine on a trained checkpoint (``stories260K``): each adapter's
greedy output equals ``transformers`` + ``peft`` with the adapter merged into the
weights, alone and in one batch with another adapter and the base model; adapters never
share prefix-cache blocks; a step never holds more adapters than ``max_loras`` slots;
adapters the engine cannot run are refused, naming why."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from lamina.services.engine_worker.engine.lora import LoraAdapterError, UnknownLoraError
from tests.engine.helpers import LORA_TARGETS, drain, greedy, hf_greedy, make_adapter, make_engine

PROMPTS = {
    "a": [1, 400, 261, 403],
    "b": [1, 306, 323, 283, 272, 260, 389],
    "c": [1, 73, 87, 316],
}


@pytest.fixture(scope="module")
def adapters(stories, tmp_path_factory):
    """Two adapters (rank 4 on every projection; rank 2 on Q and V, rsLoRA scaling) and
    their merged reference models."""
    root = tmp_path_factory.mktemp("adapters")
    merged = {
        "sql": make_adapter(stories, root / "sql", 4, 8, LORA_TARGETS, 0),
        "chat": make_adapter(stories, root / "chat", 2, 4, ["q_proj", "v_proj"], 1),
    }
    config = json.loads((root / "chat" / "adapter_config.json").read_text())
    assert not config["use_rslora"]
    return root, merged


def lora_engine(stories, root, **overrides):
    modules = f"sql={root / 'sql'} chat={root / 'chat'}"
    from lamina.services.engine_worker.engine.lora import LoraModules

    config = dict(lora_modules=LoraModules.parse(modules), max_loras=2, max_num_batched_tokens=64)
    return make_engine(stories, **(config | overrides))


def run(engine, requests, max_tokens=60):
    """``requests``: id → (prompt, adapter or None); all added at once."""
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, greedy(max_tokens), lora=lora)
    return drain(engine)


def test_each_adapter_matches_peft_merged_weights_in_one_mixed_batch(stories, adapters):
    import transformers

    root, merged = adapters
    base = transformers.AutoModelForCausalLM.from_pretrained(stories).eval()
    requests = {}
    for name, prompt in PROMPTS.items():
        for lora in (None, "sql", "chat"):
            requests[f"{name}/{lora}"] = (prompt, lora)
    outputs = run(lora_engine(stories, root), requests)
    for request_id, (prompt, lora) in requests.items():
        want = hf_greedy(merged[lora] if lora else base, prompt, 60)
        assert outputs[request_id] == want, request_id
    for name in PROMPTS:  # the adapters do change the output
        assert outputs[f"{name}/sql"] != outputs[f"{name}/None"]
        assert outputs[f"{name}/chat"] != outputs[f"{name}/None"]


@pytest.mark.parametrize(
    "layout",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["two tensor-parallel ranks", "two pipeline stages"],
)
def test_adapters_across_ranks_match_peft_merged_weights(stories, adapters, layout):
    """Each rank adds its share of the adapters' products (a stage its layers; a
    tensor-parallel rank its heads' and MLP slice's rows, or its inputs' columns before
    the all-reduce): the mixed batch's output is still peft's. One slot, so the adapters
    take turns in it and every rank's slot is rewritten while the batch runs."""
    root, merged = adapters
    engine = lora_engine(stories, root, max_loras=1, **layout)
    try:
        requests = {}
        for name, prompt in PROMPTS.items():
            for lora in ("sql", "chat"):
                requests[f"{name}/{lora}"] = (prompt, lora)
        outputs = run(engine, requests, max_tokens=20)
    finally:
        engine.close()
    for request_id, (prompt, lora) in requests.items():
        assert outputs[request_id] == hf_greedy(merged[lora], prompt, 20), request_id


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_steps_with_adapters_run_the_native_step(
    stories, adapters, monkeypatch, quantization
):
    """Every weight packed, so a decode step with adapters runs the native decode step,
    their products inside it (``decode.cpp``, gate/up's before its activation): the
    mixed batch's output is peft's (fp32), and the same as the layer-by-layer forward's
    (int8 weights, which peft does not have)."""
    import transformers

    monkeypatch.setenv("LAMINA_CPU_LINEAR", "native")
    monkeypatch.setattr("lamina.kernels.linear.NATIVE_MIN_ELEMENTS", 0)  # pack every weight
    root, merged = adapters
    requests = {
        f"{name}/{lora}": (p, lora) for name, p in PROMPTS.items() for lora in (None, "sql", "chat")
    }
    engine = lora_engine(stories, root, quantization=quantization)
    runner, left = engine.runner, []
    forward = runner._forward

    def layer_by_layer(step, lora):
        left.append(step.decodes_only and step.all_sampled and lora is not None)
        return forward(step, lora)

    runner._forward = layer_by_layer
    outputs = run(engine, requests, max_tokens=30)
    assert runner.model._native[1] is not None and left and not any(left)
    if quantization is None:
        base = transformers.AutoModelForCausalLM.from_pretrained(stories).eval()
        for request_id, (prompt, lora) in requests.items():
            want = hf_greedy(merged[lora] if lora else base, prompt, 30)
            assert outputs[request_id] == want, request_id
    else:
        python = lora_engine(stories, root, quantization=quantization)
        python.runner.model.native_decode = False
        assert run(python, requests, max_tokens=30) == outputs


def test_adapters_on_a_bf16_model_run_the_torch_forms(stories, adapters, monkeypatch):
    """The cpu kernels take a bf16 model but the native LoRA kernel takes fp32: its
    adapters' products run as the torch forms, and they do change the output."""
    monkeypatch.setenv("LAMINA_KERNELS", "cpu")
    root, _ = adapters
    engine = lora_engine(stories, root, dtype="bfloat16")
    assert engine.runner.model.ops.backend == "cpu"
    assert engine.runner.lora_slots.kernel_rows == 0
    prompt = PROMPTS["a"]
    outputs = run(engine, {"base": (prompt, None), "sql": (prompt, "sql")}, 20)
    assert len(outputs["sql"]) == len(outputs["base"]) == 20
    assert outputs["sql"] != outputs["base"]


def test_adapters_never_share_prefix_cache_blocks(stories, adapters):
    root, _ = adapters
    engine = lora_engine(stories, root)
    prompt = list(range(1, 50))  # three full blocks
    first = {}
    for lora in (None, "sql", "chat", "sql"):
        engine.add_request(f"r{len(first)}", prompt, greedy(4), lora=lora)
        outputs = []
        while engine.has_work():
            outputs += engine.step().outputs
        first[(len(first), lora)] = outputs[0].num_cached_tokens
    assert first == {(0, None): 0, (1, "sql"): 0, (2, "chat"): 0, (3, "sql"): 48}


def test_a_step_holds_at_most_max_loras_adapters(stories, adapters):
    root, merged = adapters
    engine = lora_engine(stories, root, max_loras=1)
    requests = {
        f"{name}/{lora}": (p, lora) for name, p in PROMPTS.items() for lora in ("sql", "chat")
    }
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, greedy(20), lora=lora)
    engine.add_request("base", PROMPTS["a"], greedy(20))
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        running = {r.lora for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= 1
    for request_id, (prompt, lora) in requests.items():
        assert outputs[request_id] == hf_greedy(merged[lora], prompt, 20), request_id
    assert len(outputs["base"]) == 20  # the base model's request ran beside them


def test_unknown_adapter_is_refused_by_name(stories, adapters):
    root, _ = adapters
    engine = lora_engine(stories, root)
    with pytest.raises(UnknownLoraError, match="'nope'"):
        engine.add_request("x", [1, 2, 3], greedy(2), lora="nope")
    plain = make_engine(stories)
    with pytest.raises(Exception, match="serves no LoRA adapters"):
        plain.add_request("x", [1, 2, 3], greedy(2), lora="sql")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, w: c.update(use_dora=True), "DoRA"),
        (lambda c, w: c.update(r=64, lora_alpha=64), "above --max-lora-rank"),
        (lambda c, w: c.update(bias="all"), "biases"),
        (
            lambda c, w: w.update(
                {"base_model.model.lm_head.lora_A.weight": w[next(iter(w))].clone()}
            ),
            "decoder layers",
        ),
        (
            lambda c, w: w.pop(next(k for k in w if "lora_B" in k)),
            "lora_A and lora_B must come together",
        ),
    ],
)
def test_adapters_it_cannot_run_are_refused(stories, adapters, tmp_path, change, message):
    root, _ = adapters
    config = json.loads((root / "sql" / "adapter_config.json").read_text())
    weights = load_file(root / "sql" / "adapter_model.safetensors")
    change(config, weights)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file(weights, tmp_path / "adapter_model.safetensors")
    engine = lora_engine(stories, root)
    with pytest.raises(LoraAdapterError, match=message):
        engine.load_adapter("bad", tmp_path)
    assert "bad" not in engine.adapters


def test_adapters_added_and_removed_at_run_time(stories, adapters):
    from lamina.services.engine_worker.engine.lora import (
        LoraAdapter,
        LoraExistsError,
        LoraInUseError,
    )

    root, merged = adapters
    engine = make_engine(stories, enable_lora=True, max_loras=1, max_num_batched_tokens=64)
    adapter = LoraAdapter.load("sql", root / "sql", engine.model_config, 16)
    engine.add_adapter(adapter)
    with pytest.raises(LoraExistsError):
        engine.add_adapter(adapter)
    engine.add_request("r", PROMPTS["a"], greedy(30), lora="sql")
    engine.step()
    with pytest.raises(LoraInUseError):
        engine.remove_adapter("sql")
    assert drain(engine)["r"] == hf_greedy(merged["sql"], PROMPTS["a"], 30)[1:]
    engine.remove_adapter("sql")
    with pytest.raises(UnknownLoraError):
        engine.remove_adapter("sql")
    with pytest.raises(UnknownLoraError):
        engine.add_request("again", PROMPTS["a"], greedy(2), lora="sql")
    # Loaded again (a new version, say) into the slot it left: its own output, not stale.
    engine.load_adapter("sql", root / "chat")
    engine.add_request("chat", PROMPTS["b"], greedy(30), lora="sql")
    assert drain(engine)["chat"] == hf_greedy(merged["chat"], PROMPTS["b"], 30)


def test_adapters_on_the_triton_kernels(stories, adapters, monkeypatch):
    """The same mixed batch on the Triton backend (the interpreter, on a CPU): the
    adapters' products by the Triton BGMV kernels, each output still peft's."""
    pytest.importorskip("triton")
    import transformers

    monkeypatch.setenv("LAMINA_KERNELS", "triton")
    root, merged = adapters
    base = transformers.AutoModelForCausalLM.from_pretrained(stories).eval()
    engine = lora_engine(stories, root)
    assert engine.runner.model.ops.backend == "triton"
    requests = {f"{lora}": (PROMPTS["b"], lora) for lora in (None, "sql", "chat")}
    outputs = run(engine, requests, max_tokens=8)
    for request_id, (prompt, lora) in requests.items():
        assert outputs[request_id] == hf_greedy(merged[lora] if lora else base, prompt, 8)


def test_adapters_with_speculative_decoding(stories, adapters):
    """Drafted tokens go through the request's adapter too: greedy output unchanged."""
    from lamina.services.engine_worker.engine.speculative import SpeculativeConfig

    root, merged = adapters
    ngram = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = lora_engine(stories, root, speculative_config=ngram)
    requests = {name: (prompt, "sql") for name, prompt in PROMPTS.items()}
    outputs = run(engine, requests, max_tokens=80)
    for request_id, (prompt, lora) in requests.items():
        assert outputs[request_id] == hf_greedy(merged[lora], prompt, 80), request_id
    assert engine.stats().spec_decode_num_accepted_tokens > 0
