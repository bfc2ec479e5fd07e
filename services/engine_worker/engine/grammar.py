"""Structured output in the engine: each constrained request's matcher, and the compiler
that builds matchers for this model's vocabulary.

A constrained request carries a :class:`GrammarState`. When a step starts, the masks of
every constrained row that samples in it are filled by one llguidance call (Rust, the
GIL released) on a thread of its own, while the model runs (:class:`BatchMasks`); the
sampler then unpacks them and applies them to the logits in one masked fill, and the
engine advances each matcher with its sampled token. Once the value is complete only the
model's EOS is allowed, and the request ends ``stop`` on it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llguidance
import numpy as np
import torch
from llguidance.torch import (
    allocate_token_bitmask,
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from lamina.libs.bounded import BoundedDict
from lamina.services.engine_worker.engine.errors import InvalidRequestError

_FIRST_MASK_LIMIT_S = 0.25
"""Longest a new grammar's first mask may take to compute (tens of µs for usual ones)."""

_CACHED_GRAMMARS = 512
"""Compiled grammars kept per worker (an agent sends the same schema with every request)."""

Compiled = llguidance.LLMatcher
"""A grammar compiled for one vocabulary, at its start: copied for each request."""

_BITS = torch.arange(32, dtype=torch.int32)
assert sys.byteorder == "little", "the CPU bitmask unpacking reads int32 words as bytes"


class InvalidGrammarError(InvalidRequestError):
    def __init__(self, message: str) -> None:
        super().__init__(f"invalid structured output: {_plain(message)}", "structured_outputs")


def _plain(message: str) -> str:
    """The grammar engine's reason in the user's terms, on one line and bounded: its
    matcher errors carry a dump of its parser state and the whole grammar, which say
    nothing to the user and repeat what they sent."""
    if message.startswith("NoExtensionBias"):  # its parser can take no first byte
        return (
            "no output can satisfy it: it matches no text (e.g. an empty character class, "
            "or a schema whose only definition refers to itself)"
        )
    text = " ".join(message.split("<state>", 1)[0].split())
    return text if len(text) <= 300 else text[:297] + "..."


class GrammarState:
    """One request's place in its grammar."""

    __slots__ = ("finished", "matcher", "stop_token_ids")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.finished = False
        """It accepted the stop token that ends the complete output."""

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it."""
        if not self.matcher.consume_token(token):
            return False
        self.finished = token in self.stop_token_ids
        return True

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, the grammar would take in turn (the
        state does not move)."""
        return self.matcher.validate_tokens(tokens)

    def refusal(self, token: int) -> str:
        """Why ``token`` was refused: the engine's own error, or, with none, that the
        request's other rules masked every token its grammar allowed."""
        why = (
            self.matcher.get_error()
            if self.matcher.is_error()
            else ("min_tokens or a token rule left no token the grammar allows")
        )
        return f"structured output: token {token} is not allowed ({why[:300]})"


class BatchMasks:
    """The token masks of a batch's constrained rows, filled by one llguidance call on a
    thread of its own (the GIL released), so that they are computed while the model runs;
    :meth:`apply` waits for them. A request's matcher must not move until they are done
    (:meth:`wait`).

    With ``drafts`` (speculative decoding), state ``i`` has ``1 + len(drafts[i])`` rows:
    its mask now and after each draft token, as if the ones before it were output
    (llguidance advances the matcher through the draft and rolls it back). Past a draft
    token the grammar refuses, rows allow everything: verification rejects that token
    (its row masks it out), so the rows after it are never used."""

    def __init__(
        self, states: list[GrammarState | None], vocab: int, drafts: list[list[int]] | None = None
    ) -> None:
        widths = [1] * len(states) if drafts is None else [1 + len(d) for d in drafts]
        starts = np.cumsum([0, *widths])
        constrained = [
            i for i, state in enumerate(states) if state is not None and not state.finished
        ]
        self.rows = [int(starts[i]) + j for i in constrained for j in range(widths[i])]
        self.size = int(starts[-1])
        self.bitmask = allocate_token_bitmask(len(self.rows), vocab)
        self._filled = None
        if not constrained:
            return
        firsts = np.cumsum([0, *(widths[i] for i in constrained)])[:-1].tolist()
        at = list(zip(constrained, firsts, strict=True))  # (state, its first bitmask row)
        fill: Callable = fill_next_token_bitmask_par
        work: list[tuple] = [(states[i].matcher, k) for i, k in at]  # type: ignore[union-attr]
        if drafts is not None:
            fill = fill_next_token_bitmask_par_with_draft_tokens
            work = [(states[i].matcher, k, drafts[i]) for i, k in at]  # type: ignore[union-attr]
        self._filled = _FILLER.submit(fill, _EXECUTOR, work, self.bitmask)

    def wait(self) -> None:
        if self._filled is not None:
            self._filled.result()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (each state's rows, in order) with each constrained row's disallowed
        tokens at -inf: a new tensor when any row is constrained, the same one otherwise."""
        if not self.rows:
            return logits
        assert logits.shape[0] == self.size
        self.wait()
        allowed = _unpack(self.bitmask, logits.shape[1], logits.device)
        if len(self.rows) == self.size:
            return logits.masked_fill(~allowed, float("-inf"))
        banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        banned[torch.tensor(self.rows, device=logits.device)] = ~allowed
        return logits.masked_fill(banned, float("-inf"))


def apply_bitmasks(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """``logits`` masked by ``states``' grammars, the masks computed now."""
    return BatchMasks(states, logits.shape[1]).apply(logits)


def _probe(matcher: llguidance.LLMatcher, vocab: int) -> None:
    """Compute ``matcher``'s first mask here, off the engine thread (llguidance builds its
    lexer lazily): a grammar whose first mask is very slow to compute (a hostile
    ``(a{1000}){1000}`` takes seconds, and would stall every step of the batch) or that
    allows no token at all is refused now, naming why."""
    started = time.perf_counter()
    bitmask = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, bitmask, 0)
    took = time.perf_counter() - started
    if matcher.is_error():
        raise InvalidGrammarError(matcher.get_error())
    if took > _FIRST_MASK_LIMIT_S:
        raise InvalidGrammarError(
            f"too complex: its first token mask took {took:.2f} s to compute "
            f"(the limit is {_FIRST_MASK_LIMIT_S} s)"
        )
    if not bool(bitmask.any()):
        raise InvalidGrammarError("it allows no token at all")


def _unpack(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """``(rows, vocab)`` booleans from llguidance's ``(rows, words)`` int32 bitmask (bit
    ``t % 32`` of word ``t // 32``), made where the logits are: on the CPU by numpy in one
    call, on an accelerator from the packed mask (what crosses to the device)."""
    if device.type == "cpu":
        return unpack_numpy(bitmask, vocab)
    return unpack_tensor(bitmask.to(device, non_blocking=True), vocab)


def unpack_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The CPU unpacking: the int32 words read as little-endian bytes."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def unpack_tensor(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """The device unpacking: shifts and masks over the words, on their device."""
    return ((words.unsqueeze(-1) >> _BITS.to(words.device)) & 1).bool().flatten(1)[:, :vocab]


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary, caching each compiled grammar;
    thread-safe, so the worker compiles off the engine thread. The vocabulary is read
    from the model's ``tokenizer.json`` on first use (a model without one cannot take
    constraints)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: BoundedDict[str, Compiled] = BoundedDict(_CACHED_GRAMMARS)
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Compiled:
        """``grammar`` (llguidance's text: ``lamina.libs.grammar.check`` makes it from a
        request's constraint) compiled; raises :class:`InvalidGrammarError`."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        matcher = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0)
        _probe(matcher, self.vocab_size)
        with self._lock:
            self._compiled[grammar] = matcher
        return matcher

    def state(self, compiled: Compiled) -> GrammarState:
        """A fresh state for a request constrained by ``compiled``."""
        return GrammarState(compiled.deep_copy(), self.eos_token_ids)

    def _vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                path = self.model_dir / "tokenizer.json"
                if not path.exists():
                    raise InvalidGrammarError(
                        f"the model has no tokenizer.json ({path}) to compile it for"
                    )
                self._tokenizer = llguidance.LLTokenizer(
                    path.read_text(), n_vocab=self.vocab_size, eos_token=sorted(self.eos_token_ids)
                )
            return self._tokenizer


_EXECUTOR = llguidance.LLExecutor()
_FILLER = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
"""Where a batch's masks are filled while the engine thread runs the model."""
