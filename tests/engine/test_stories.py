"""Long greedy parity on a real trained checkpoint: confident logits make any engine error
show up as a diverging token, unlike random weights."""

from __future__ import annotations

from tests.engine.helpers import greedy, hf_greedy, make_engine, run_to_completion


def test_long_greedy_generation_matches_transformers(stories):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(stories).eval()
    # Token ids only: the fixture's tokenizer is a placeholder (see its README).
    prompts = {
        "a": [1, 400, 261, 403],
        "b": [1, 306, 323, 283, 272, 260, 389],
        "c": [1, 73, 87, 316],
    }
    engine = make_engine(stories, max_num_batched_tokens=64, max_model_len=256)
    ours = run_to_completion(engine, prompts, greedy(200))
    for request_id, prompt in prompts.items():
        want = hf_greedy(hf, prompt, 200)
        assert ours[request_id] == want, request_id
