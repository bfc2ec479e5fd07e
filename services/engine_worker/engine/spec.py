"""What a built engine is, as a value: safe to read from any thread, and the one place a
request is checked against it."""

from __future__ import annotations

from dataclasses import dataclass

from lamina.libs.context_length import context_overflow
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.errors import (
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    TokenOutOfVocabError,
)
from lamina.services.engine_worker.engine.grammar import (
    GrammarCompiler,
    GrammarState,
    InvalidGrammarError,
)
from lamina.services.engine_worker.engine.lora import LoraDisabledError
from lamina.services.engine_worker.engine.params import SamplingParams, check_params
from lamina.services.engine_worker.engine.request import EngineRequest


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where one of the engine's ranks runs and what it holds."""

    rank: int
    host: str
    device: str
    pid: int
    weight_bytes: int
    """Bytes of this rank's share of the model's weights."""
    kv_bytes: int = 0
    """Bytes of this rank's share of the KV pool (0 until the pool is sized)."""
    stage: int = 0
    """Its pipeline stage."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine's fixed description: its configuration (``model`` resolved) and what was
    derived from it and the checkpoint when it was built. The worker's event loop reads
    this, never the live engine on its thread."""

    config: EngineConfig
    max_model_len: int
    """Longest prompt plus output: the least of the model's, the configured, and the
    sliding window."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    """Blocks of ``config.block_size`` tokens requests can hold."""
    dtype: str
    """Activations' dtype (``bfloat16``)."""
    weight_dtype: str
    """How the weights are stored (``bfloat16``, ``int8``, ``gptq-int4``...)."""
    ranks: tuple[RankInfo, ...] = ()
    """Every rank of the model, this process (rank 0) first: one without tensor
    parallelism."""
    kv_layout: str = ""
    """Its whole KV blocks' layout (``KvBlocks.layout``, ``kv_shards.block_layout``):
    what blocks that leave it or come in (``Engine.export_blocks``, ``import_blocks``)
    carry and must match, however many ranks share them."""

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        deadline_ms: int | None = None,
        replayed: int = 0,
        grammar: GrammarState | None = None,
        lora: str | None = None,
    ) -> EngineRequest:
        """A request this engine can run; raises an :class:`InvalidRequestError` subclass,
        naming the field, if it cannot. ``replayed``: the last this-many prompt tokens are
        output the request produced before it moved. ``grammar``: a fresh state of its
        structured output constraint (:meth:`grammar_compiler`), which this advances past
        the replayed output. ``lora``: the adapter it runs with (the engine checks that
        it holds it)."""
        params = params or SamplingParams()
        if lora is not None and not self.config.enable_lora:
            raise LoraDisabledError()
        if not prompt_token_ids:
            raise EmptyPromptError()
        check_params(params)
        vocab = self.vocab_size
        for name, ids in (
            ("prompt_token_ids", prompt_token_ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias)),
            ("allowed_token_ids", params.allowed_token_ids),
            ("bad_words", [t for word in params.bad_words_token_ids for t in word]),
        ):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise TokenOutOfVocabError(min(ids) if min(ids) < 0 else max(ids), vocab, name)
        prompt_len = len(prompt_token_ids)
        if not 0 <= replayed < prompt_len:
            raise InvalidRequestError(
                f"{replayed} replayed output tokens in a prompt of {prompt_len}: "
                "at least one token must be the prompt's own",
                "replayed_output_tokens",
            )
        max_tokens = params.max_tokens or max(self.max_model_len - prompt_len, 0)
        if context_overflow(prompt_len, max_tokens, self.max_model_len):
            raise PromptTooLongError(prompt_len, max_tokens, self.max_model_len)
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            priority=priority,
            deadline_ms=deadline_ms,
            replayed=replayed,
            grammar=None if grammar is None else self._replay(grammar, prompt_token_ids, replayed),
            lora=lora,
        )

    def grammar_compiler(self) -> GrammarCompiler:
        """A compiler of structured output constraints for this engine's vocabulary."""
        return GrammarCompiler(self.config.model, self.vocab_size, self.eos_token_ids)

    @staticmethod
    def _replay(state: GrammarState, prompt: list[int], replayed: int) -> GrammarState:
        """``state`` advanced past the output the request replays."""
        for token in prompt[len(prompt) - replayed :] if replayed else ():
            if not state.accept(token):
                raise InvalidGrammarError(
                    "the output it produced before it moved does not match the constraint"
                )
        return state
