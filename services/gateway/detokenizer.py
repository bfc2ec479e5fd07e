"""Incremental detokenization and stop strings.

Text is released only once it is final: each step's tokens are decoded by the tokenizer's
own incremental decoder (``tokenizers.decoders.DecodeStream``: the new tokens rendered
together with those before them, since a token can change how its predecessors render,
e.g. a byte-level BPE character split across tokens), and text that would end in an
incomplete UTF-8 sequence is held back until the rest arrives. Stop strings hold back as
many trailing characters as the longest stop string, minus one, so a stop string split
across steps is never streamed.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from lamina.services.gateway.tokenizer import ModelTokenizer

_CONTEXT_TOKENS = 6  # tokens decoded before the held-back ones at the end, for a stable rendering


class IncrementalDetokenizer:
    """One request's output as text. ``include_stop`` keeps a matched stop string at the
    end of the text (vLLM's ``include_stop_str_in_output``); ``skip_special_tokens``
    leaves special tokens out of it (vLLM's default)."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        stop: list[str] | None = None,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._read_offset = 0  # tokens[:read_offset] are rendered in ``text``
        self.text = ""  # everything decoded so far
        self._emitted = 0  # characters of ``text`` already released
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens += token_ids
        # One id as an int: the tokenizer's binding then makes no list of it (a third of
        # the call, on a path every streamed token takes).
        ids = token_ids[0] if len(token_ids) == 1 else token_ids
        new = self._stream.step(self.tokenizer.tokenizer, ids)
        if new is not None:
            self.text += new
            self._read_offset = len(self.tokens)
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended: release what was held back (never half a stop string),
        including an incomplete UTF-8 tail, which decodes to U+FFFD."""
        if not self.stopped and self._read_offset < len(self.tokens):
            start = max(0, self._read_offset - _CONTEXT_TOKENS)
            prefix = self._decode(self.tokens[start : self._read_offset])
            full = self._decode(self.tokens[start:])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.tokens)
        return self._release(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, final: bool) -> str:
        if self.stop:
            start = max(0, self._emitted - self._hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))  # earliest
                self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
