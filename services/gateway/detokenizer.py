"""Incremental detokenization and stop strings.

Text is released only once it is final: the newest tokens are decoded together with a few
tokens before them (a token can change how its predecessors render, e.g. a byte-level BPE
character split across tokens), and output ending in U+FFFD (an incomplete UTF-8
sequence) is held back until the rest arrives. Stop strings hold back as many trailing
characters as the longest stop string, minus one, so a stop string split across steps is
never streamed.
"""

from __future__ import annotations

from lamina.services.gateway.tokenizer import ModelTokenizer

_CONTEXT_TOKENS = 6  # tokens decoded before the new ones, for a stable rendering


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._prefix_offset = 0  # tokens[prefix_offset:read_offset] are already rendered
        self._read_offset = 0
        self.text = ""  # everything decoded so far
        self._emitted = 0  # characters of ``text`` already released
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that became final (possibly empty)."""
        if self.stopped:
            return ""
        self.tokens += token_ids
        prefix = self.tokenizer.decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.tokens[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._read_offset = len(self.tokens)
            self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended: release what was held back (never half a stop string),
        including an incomplete UTF-8 tail, which decodes to U+FFFD."""
        if not self.stopped and self._read_offset < len(self.tokens):
            prefix = self.tokenizer.decode(self.tokens[self._prefix_offset : self._read_offset])
            full = self.tokenizer.decode(self.tokens[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            start = max(0, self._emitted - self._hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
