"""Batched, vectorised sampling: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One pass over the ``(S, vocab)`` logits for the whole batch; Python loops only over the
requests that need something special (a seed, an active ``min_tokens``). Sampling uses the
exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which equals drawing from ``p``
and lets each seeded request draw its noise from its own generator, so its tokens do not
depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.kernels.transfer import upload
from lamina.services.engine_worker.engine.grammar import BatchMasks, apply_bitmasks
from lamina.services.engine_worker.engine.request import Request

SampledLogprob = tuple[float, list[tuple[int, float]]]
"""The sampled token's logprob and the top-N ``(token id, logprob)`` alternatives."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampledLogprob | None]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], masks: BatchMasks | None = None
    ) -> SamplerOutput:
        """Pick one token for each row of ``logits`` ``(S, vocab)`` (fp32). ``masks``: the
        requests' grammar masks, if started already (else computed here)."""
        params = [r.params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        # ``logits`` is left as it is (every step below makes a new tensor), so that the
        # engine can sample a row again alone when the batch raises.
        if masks is not None:
            logits = masks.apply(logits)
        elif any(r.grammar is not None for r in requests):
            logits = apply_bitmasks(logits, [r.grammar for r in requests])
        if any(p.has_penalties for p in params):
            outputs = [r.generated_token_ids for r in requests]
            logits = self._apply_penalties(logits, requests, outputs)
        logits = self._hold_ends(logits, requests, [r.num_output_tokens for r in requests])
        if any(p.has_token_rules for p in params):
            logits = self._apply_token_rules(logits, requests)

        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests, greedy)
        token_list = tokens.tolist()
        out_logprobs: list[SampledLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for row, want in enumerate(want_logprobs):
                if want:
                    out_logprobs[row] = _logprobs(
                        raw_logprobs[row], token_list[row], params[row].logprobs or 0
                    )
        return SamplerOutput(token_list, out_logprobs)

    def _hold_ends(
        self, logits: torch.Tensor, requests: list[Request], produced: list[int]
    ) -> torch.Tensor:
        """EOS and stop tokens masked in each row whose request has produced
        ``produced[row]`` tokens, fewer than its ``min_tokens``."""
        suppress = [i for i, r in enumerate(requests) if produced[i] < r.params.min_tokens]
        if not suppress:
            return logits
        # One fill over flat (row, token) indices. (Assigning a Python float through an
        # index tensor copies the scalar to the device, which waits on CUDA.)
        vocab = logits.shape[1]
        flat = [
            row * vocab + token
            for row in suppress
            for token in sorted(set(requests[row].params.stop_token_ids) | set(self.eos_token_ids))
        ]
        index = upload(flat, torch.int64, logits.device)
        return logits.reshape(-1).index_fill(0, index, float("-inf")).view_as(logits)

    def _apply_token_rules(
        self, logits: torch.Tensor, requests: list[Request], outputs: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Logit biases, allowed tokens and bad words, by token id: one add, one fill
        and one masked fill over the whole batch (a new tensor; ``logits`` is kept). Bad
        words match the end of ``outputs[row]`` (default: the request's output)."""
        vocab = logits.shape[1]
        flat = logits.reshape(-1).clone()
        biased: list[int] = []
        biases: list[float] = []
        banned: list[int] = []
        allowed_rows: list[int] = []
        allowed: list[int] = []
        for row, request in enumerate(requests):
            params = request.params
            for token, bias in params.logit_bias.items():
                biased.append(row * vocab + token)
                biases.append(bias)
            if params.bad_words_token_ids:
                output = request.generated_token_ids if outputs is None else outputs[row]
                for word in params.bad_words_token_ids:
                    prefix = word[:-1]
                    if not prefix or output[len(output) - len(prefix) :] == prefix:
                        banned.append(row * vocab + word[-1])
            if params.allowed_token_ids is not None:
                allowed_rows.append(row)
                base = (len(allowed_rows) - 1) * vocab
                allowed += [base + t for t in params.allowed_token_ids]
        device = logits.device
        if biased:
            index = upload(biased, torch.int64, device)
            flat.index_add_(0, index, upload(biases, torch.float32, device))
        if banned:
            flat.index_fill_(0, upload(banned, torch.int64, device), float("-inf"))
        out = flat.view_as(logits)
        if allowed_rows:
            rows = upload(allowed_rows, torch.int64, device)
            keep = torch.zeros(len(allowed_rows) * vocab, dtype=torch.bool, device=device)
            keep.index_fill_(0, upload(allowed, torch.int64, device), True)
            kept = out[rows].masked_fill(~keep.view(len(allowed_rows), vocab), float("-inf"))
            out = out.index_copy(0, rows, kept)
        return out

    def _apply_penalties(
        self, logits: torch.Tensor, requests: list[Request], outputs: list[list[int]]
    ) -> torch.Tensor:
        """Each row's penalties (of its request, ``requests[row]``) over the output
        ``outputs[row]``: the request's, or (verifying a draft) its output followed by the
        draft tokens before that row."""
        vocab = logits.shape[1]
        dev = logits.device
        reps = [r.params.repetition_penalty for r in requests]
        rep = upload(reps, torch.float32, dev)
        pres = upload([r.params.presence_penalty for r in requests], torch.float32, dev)
        freq = upload([r.params.frequency_penalty for r in requests], torch.float32, dev)
        # Counts over generated tokens drive presence/frequency (OpenAI); the repetition
        # penalty covers prompt and output (Hugging Face / vLLM).
        output_counts = _token_counts(outputs, vocab, dev)
        seen = output_counts > 0
        if any(r != 1.0 for r in reps):
            seen_any = seen | (
                _token_counts([r.prompt_token_ids for r in requests], vocab, dev) > 0
            )
            penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
            logits = torch.where(seen_any, penalised, logits)
        return logits - (freq[:, None] * output_counts + pres[:, None] * seen)

    def verify(
        self, logits: torch.Tensor, requests: list[Request], masks: BatchMasks | None = None
    ) -> list[tuple[list[int], list[SampledLogprob] | None]]:
        """Verify each request's draft (speculative decoding): ``logits`` holds, for each
        request in turn, ``1 + len(request.draft)`` rows, the distributions of the token
        after its last token and after each draft token. Returns each request's tokens:
        the draft's accepted prefix and one token of the target's own (the correction at
        the first rejection, or the next token when all are accepted), and their
        logprobs when asked for.

        Greedy requests accept a draft token when it is the argmax. Sampled ones accept
        draft token ``d`` with probability ``p(d)`` and, on a rejection, draw from ``p``
        without ``d`` (renormalised): a draft is one proposed token, so that is rejection
        sampling's residual ``max(p - q, 0)``, and each output token is distributed
        exactly as ``p``. A row stands for the draft tokens before it having been output
        (it is used only when they were): its penalties count them, its bad words match
        after them, and ``min_tokens`` holds off EOS while they leave the output short.
        ``masks``: the requests' grammar masks per row (``BatchMasks`` with drafts: each
        row's as if the draft tokens before it were output); a draft token its grammar
        refuses is masked out of its row, so rejected. A seeded request draws each row's
        token with its own generator and keeps draft tokens while they equal the draws
        (:meth:`_seeded_draw`). Logit biases and allowed tokens apply to every row alike."""
        rows = [r for r in requests for _ in range(len(r.draft) + 1)]
        params = [r.params for r in rows]
        dev = logits.device
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        if masks is not None:
            logits = masks.apply(logits)
        outputs = None
        if any(p.has_penalties or p.bad_words_token_ids for p in params):
            outputs = [
                r.generated_token_ids + r.draft[:i]
                for r in requests
                for i in range(len(r.draft) + 1)
            ]
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, rows, outputs)
        produced = [r.num_output_tokens + i for r in requests for i in range(len(r.draft) + 1)]
        logits = self._hold_ends(logits, rows, produced)
        if any(p.has_token_rules for p in params):
            logits = self._apply_token_rules(logits, rows, outputs)
        argmax = logits.argmax(dim=-1).tolist()
        probs: torch.Tensor | None = None
        if not all(p.greedy for p in params):
            probs = self._probabilities(logits, params)
            proposed = [t for r in requests for t in (*r.draft, 0)]  # (0: the last row's)
            index = upload(proposed, torch.int64, dev)[:, None]
            p_proposed = probs.gather(1, index).squeeze(1).tolist()
            uniform = torch.rand(len(rows), generator=self.generator, device=dev).tolist()
        results: list[tuple[list[int], list[SampledLogprob] | None]] = []
        row = 0
        for request in requests:
            draft, tokens = request.draft, []
            seeded = request.generator is not None and not request.params.greedy
            for i, proposed_token in enumerate(draft):
                if request.params.greedy:
                    token = argmax[row + i]
                elif seeded:  # its own draw for this position, as if it had no draft
                    token = self._seeded_draw(probs[row + i], request)  # type: ignore[index]
                elif uniform[row + i] < p_proposed[row + i]:
                    token = proposed_token
                else:
                    token = self._draw(probs[row + i], without=proposed_token)  # type: ignore[index]
                tokens.append(token)
                if token != proposed_token:
                    break
            else:
                last = row + len(draft)
                if request.params.greedy:
                    tokens.append(argmax[last])
                elif seeded:
                    tokens.append(self._seeded_draw(probs[last], request))  # type: ignore[index]
                else:
                    tokens.append(self._draw(probs[last]))  # type: ignore[index]
            top_n = request.params.logprobs
            logprobs = None
            if raw_logprobs is not None and top_n is not None:
                logprobs = [
                    _logprobs(raw_logprobs[row + i], token, top_n) for i, token in enumerate(tokens)
                ]
            results.append((tokens, logprobs))
            row += len(draft) + 1
        return results

    def _seeded_draw(self, probs: torch.Tensor, request: Request) -> int:
        """One token from ``probs`` (one row) by ``request``'s own generator, drawing as
        :meth:`_sample` does for it: a draft token is kept when this draw is that token,
        which for a one-token proposal is rejection sampling (kept with probability
        ``p(d)``, else a token of ``p`` without ``d``), and leaves the generator where
        decoding the same tokens one by one would: the output is the same as without a
        draft, seed for seed."""
        return int((probs / self._request_noise(request, probs)).argmax())

    def _request_noise(self, request: Request, like: torch.Tensor) -> torch.Tensor:
        """The exponential noise of a seeded request's next token (a row like ``like``),
        after the draws of the tokens replayed to it (``pending_draws``)."""
        noise = torch.empty_like(like)
        for _ in range(request.pending_draws):
            noise.exponential_(generator=request.generator)
        request.pending_draws = 0
        return noise.exponential_(generator=request.generator)

    def _draw(self, probs: torch.Tensor, without: int | None = None) -> int:
        """One token from the distribution ``probs`` (one row), ``without`` one token
        (renormalised; that token itself if it held all the mass)."""
        if without is not None:
            rest = probs.clone()
            rest[without] = 0.0
            if not bool(rest.any()):
                return without
            probs = rest
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return int((probs / noise).argmax())

    def _probabilities(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Each row's sampling distribution: temperature (a greedy row's is 1: it takes
        the argmax), then top-k, top-p and min-p."""
        temperature = [1.0 if p.greedy else p.temperature for p in params]
        scaled = logits / upload(temperature, torch.float32, logits.device)[:, None]
        if any(p.has_filters for p in params):
            scaled = _filter(scaled, params)
        return torch.softmax(scaled, dim=-1)

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]
    ) -> torch.Tensor:
        params = [r.params for r in requests]
        dev = logits.device
        greedy_rows = upload(greedy, torch.bool, dev)
        probs = self._probabilities(logits, params)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.generator is not None and not greedy[row]:
                noise[row] = self._request_noise(request, noise[row])
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows, logits.argmax(dim=-1), sampled)


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``(S, vocab)`` occurrence counts of each row's tokens."""
    width = max((len(t) for t in token_lists), default=0)
    index = torch.full((len(token_lists), width + 1), vocab, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        index[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(
        1, upload(index, torch.int64, device), torch.ones(index.shape, device=device)
    )
    return counts[:, :vocab]


def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Mask (to -inf) tokens removed by each row's top-k, top-p and min-p."""
    dev = logits.device
    vocab = logits.shape[-1]
    top_k = upload([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, dev)
    top_p = upload([p.top_p for p in params], torch.float32, dev)
    min_p = upload([p.min_p for p in params], torch.float32, dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass strictly before it is below top_p (the first always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def _logprobs(row: torch.Tensor, token: int, top_n: int) -> SampledLogprob:
    alternatives: list[tuple[int, float]] = []
    if top_n:
        values, ids = row.topk(top_n)
        alternatives = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(row[token]), alternatives
