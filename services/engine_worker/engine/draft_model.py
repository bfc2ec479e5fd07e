"""Speculative decoding by a draft model: a smaller checkpoint of the target's tokenizer
proposes each drafted request's next tokens, one greedy decode pass of its own per draft
position (``--speculative-config '{"model": "/path", "num_speculative_tokens": 4}'``).

A separate checkpoint rather than the target's own first layers: an early exit that was
not trained for (LayerSkip and EAGLE train theirs) agrees with the target rarely, and a
draft of ``N`` of ``L`` layers costs ``k·N/L`` of a step for ``k`` tokens, which leaves
nothing to gain unless it is both shallow and right; a small model trained on the same
data is both, and any checkpoint of the same vocabulary will do.

The draft's KV lives in a pool of its own with as many blocks as the target's, addressed
by the target's block tables, and every target step runs through the draft model as well
(:meth:`DraftModel.mirror`: the same tokens, slots and moves between tiers, with lower
tiers of the same slots). So wherever the target holds a token's KV, the draft holds its
own for the same token: prefix-cache hits, chunked prefill, preemption and tier reloads
need nothing more. Except while an adaptive engine's gate holds drafts off: then steps
without drafts skip the draft model (its cost is what the gate found does not pay), each
request remembers where its draft KV was left behind (``Request.draft_stale_from``), and
its next draft's first pass computes the draft's KV from there as one chunk, its last
token included. Blocks a request filled meanwhile and left in the prefix cache keep
stale draft KV for another request that hits them: acceptance, not output.

The draft passes write the draft positions' KV into the slots the
scheduler gave the draft; the target step's mirror writes them again from the tokens that
were verified, and a rejected position's are overwritten when its slot is next computed.
Blocks imported from another worker carry the target's KV only: the draft's for them are
stale, which costs acceptance, never output (verification keeps the target's
distribution whatever is proposed).

Drafts are greedy (the draft model's argmax), a point-mass proposal, which the sampler's
verification keeps exact for sampled requests too (``Sampler.verify``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lamina.services.engine_worker.engine.batch_scheduler import ScheduledBatch
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.lora import LoraModules
from lamina.services.engine_worker.engine.parallel import SINGLE, WHOLE
from lamina.services.engine_worker.engine.request import Request
from lamina.services.engine_worker.engine.runner import NO_ADAPTERS, StepInput
from lamina.services.engine_worker.engine.shard import Shard, load_shard


def load_draft(config: EngineConfig, target: Shard) -> Shard:
    """The draft checkpoint of ``config.speculative_config``, loaded whole on the target's
    device (before the KV pools are sized: its weights take from their budget), checked
    against the ``target`` it drafts for."""
    spec = config.speculative_config
    assert spec is not None and spec.model
    own = dataclasses.replace(
        config,
        model=Path(spec.model),
        quantization=None,
        speculative_config=None,
        enable_lora=False,
        lora_modules=LoraModules(),
    )
    draft = load_shard(own, SINGLE, WHOLE, target.device)
    if draft.model_config.vocab_size != target.model_config.vocab_size:
        raise ValueError(
            f"the draft model {spec.model} has a vocabulary of "
            f"{draft.model_config.vocab_size} tokens and the target "
            f"{target.model_config.vocab_size}: a draft model must share the target's "
            "tokenizer"
        )
    if draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"the draft model {spec.model} runs {draft.max_model_len} positions, fewer than "
            f"the target's max_model_len ({target.max_model_len}): lower max_model_len"
        )
    return draft


class DraftModel:
    """The draft model (:func:`load_draft`) with a KV pool of ``num_blocks`` blocks and
    lower tiers of ``tier_slots``: the target's, block for block."""

    def __init__(self, shard: Shard, num_blocks: int, tier_slots: dict[int, int]) -> None:
        self.block_size = shard.config.block_size
        self.runner = shard.runner(num_blocks, tier_slots)

    def mirror(self, step: StepInput) -> None:
        """Run the target's ``step`` through the draft model: its KV for the step's tokens,
        and the step's moves between tiers (LoRA adapters are the target's alone)."""
        self.runner.run(dataclasses.replace(step, adapters=NO_ADAPTERS))

    def transfer(self, moves: np.ndarray) -> None:
        """Moves between tiers made outside a step (the target's export and import)."""
        self.runner.transfer(moves)

    def propose(self, batch: ScheduledBatch) -> None:
        """Fill the drafts the scheduler made room for in ``batch`` (as many tokens as
        each request's ``draft`` holds, placeholders until now): pass ``j`` computes each
        request's token ``j`` of ``[last token, *draft]`` and writes the argmax into
        ``draft[j]``; requests whose draft is shorter drop out of later passes. The first
        pass also computes what a request's draft KV was left behind on (a chunk from
        ``draft_stale_from``)."""
        rows = [(r, t) for r, t in zip(batch.requests, batch.block_tables, strict=True) if r.draft]
        if not rows:
            return
        table = np.zeros((len(rows), max(len(t) for _, t in rows)), dtype=np.int64)
        for i, (_, blocks) in enumerate(rows):
            table[i, : len(blocks)] = blocks
        for j in range(max(len(r.draft) for r, _ in rows)):
            passing = []  # (row, first position, tokens)
            for i, (request, _) in enumerate(rows):
                if len(request.draft) > j:
                    first = self._first(request, j)
                    tokens = request.token_ids[first:] if j == 0 else [request.draft[j - 1]]
                    passing.append((i, first, tokens))
            passing.sort(key=lambda p: len(p[2]) > 1)  # one-token rows first, as decodes
            live, firsts, tokens = zip(*passing, strict=True)
            logits = self.runner.run(self._step(tokens, firsts, table[list(live)]))
            for i, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                rows[i][0].draft[j] = token
                rows[i][0].draft_stale_from = None

    @staticmethod
    def _first(request: Request, j: int) -> int:
        """The first position draft pass ``j`` computes for ``request``."""
        last = request.num_tokens - 1 + j
        if j or request.draft_stale_from is None:
            return last
        return min(request.draft_stale_from, last)

    def _step(
        self, tokens: Sequence[list[int]], firsts: Sequence[int], table: np.ndarray
    ) -> StepInput:
        """A draft pass: each row's ``tokens`` from position ``firsts`` on, its last one
        sampled (rows of one token first, as a step's decodes are)."""
        counts = np.asarray([len(t) for t in tokens], dtype=np.int64)
        ends = np.cumsum(counts)
        starts = np.asarray(firsts, dtype=np.int64)
        positions = np.arange(int(ends[-1])) - np.repeat(ends - counts - starts, counts)
        row = np.repeat(np.arange(len(tokens)), counts)
        bs = self.block_size
        slots = table[row, positions // bs] * bs + positions % bs
        decodes = int(np.argmax(counts != 1)) if (counts != 1).any() else len(tokens)
        return StepInput(
            ids=np.asarray([t for ts in tokens for t in ts], dtype=np.int64),
            positions=positions,
            slots=slots,
            num_new=counts,
            context=starts,
            table=table,
            sampled=ends - 1,
            num_decodes=decodes,
            decodes_only=decodes == len(tokens),
            all_sampled=True,
        )
