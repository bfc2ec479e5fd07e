"""Incremental detokenization: never broken UTF-8 mid-stream, stop strings never leak."""

from __future__ import annotations

import random

import pytest

from lamina.services.gateway.detokenizer import IncrementalDetokenizer
from lamina.services.gateway.tokenizer import ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return ModelTokenizer(tiny_model)


def stream(tokenizer, ids, stop=None, step=1):
    d = IncrementalDetokenizer(tokenizer, stop)
    pieces = [d.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(d.flush())
    return pieces, d


@pytest.mark.parametrize("text", ["plain words here", "déjà vu 🙂 ok", "🙂🙂", "a\nb  c"])
def test_streamed_text_equals_full_decode_and_is_valid_utf8(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("model", ["tiny_model", "stories"])
def test_any_tokens_in_any_steps_stream_the_full_decode(model, request):
    """Random token ids (special, byte-fallback and partial UTF-8 ones included), fed one
    to three at a time: the pieces join to what decoding them all at once gives, with or
    without special tokens, for a byte-level BPE (``tiny``) and a SentencePiece tokenizer
    with byte fallback (``stories260K``)."""
    tok = ModelTokenizer(request.getfixturevalue(model))
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 24))]
        skip, step = rng.random() < 0.7, rng.randint(1, 3)
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = [d.add(ids[i : i + step]) for i in range(0, len(ids), step)]
        pieces.append(d.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), (ids, step)


def test_stop_string_split_across_tokens_is_never_streamed(tokenizer):
    ids = tokenizer.encode("the model is great and the cache is warm")
    pieces, d = stream(tokenizer, ids, stop=["great and"])
    assert "".join(pieces) == "the model is "
    assert d.stopped
    assert not any("great" in p for p in pieces)


def test_incomplete_utf8_at_the_end_is_released_on_flush(tokenizer):
    ids = tokenizer.encode("ok 🙂")[:-1]  # cut inside the emoji's bytes
    pieces, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces[:-1])  # held back while incomplete
    assert pieces[-1].endswith("\ufffd")  # released as U+FFFD when the request ends
    assert "".join(pieces) == tokenizer.decode(ids)


def test_a_matched_stop_string_is_kept_when_asked(tokenizer):
    ids = tokenizer.encode("the model is great and the cache is warm")
    d = IncrementalDetokenizer(tokenizer, ["cache", "great and"], include_stop=True)
    pieces = [d.add([t]) for t in ids] + [d.flush()]
    assert "".join(pieces) == "the model is great and" and d.stopped
    # Two that start at the same place, found in one step: the longer is kept.
    d = IncrementalDetokenizer(tokenizer, ["great", "great and"], include_stop=True)
    assert d.add(ids) + d.flush() == "the model is great and"


def test_special_tokens_are_left_out_unless_asked(tokenizer):
    special = tokenizer.tokenizer.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("hello"), special, *tokenizer.encode(" world")]
    skipped, _ = stream(tokenizer, ids)
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    text = "".join([kept.add(ids), kept.flush()])
    assert "".join(skipped) == "hello world"
    assert text == "hello<|im_end|> world"
