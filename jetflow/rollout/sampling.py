"""Token sampling as pure functions on logits (B, V).

The order of operations is the one Hugging Face and vLLM use: temperature, then top-k, then top-p.
Filtering sets the removed logits to -inf, so the *sampling distribution* is

    pi(a) = softmax(filter(logits / temperature))[a]

and the log-prob returned for a sampled token is log pi(a) (what an importance ratio against the
trainer's policy needs), computed by `jetflow.model.logprobs.token_logprobs`, the function the
trainer computes its log-probs with: unfiltered, the two agree bit for bit on the same logits.
Greedy decoding (temperature 0) picks argmax(logits) and returns log_softmax(logits)[a]: the
log-prob of that token under the unfiltered, untempered model.

Sampling inverts the CDF: one uniform u per row picks the first token whose cumulative weight
exceeds u * total (weights exp(score - max) in fp32, cumulated in float64 so that rounding in the
running sum does not shift the boundaries of small-probability tokens).
That costs one random number per row instead of one per vocabulary entry (Gumbel-max), which matters
at 49k-entry vocabularies on a CPU. Each row's uniform comes from that row's own torch.Generator, so
a request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetflow.model.logprobs import tempered, token_logprobs

# Candidate set for the top-p fast path: the exact answer is found within the top TOP_P_CANDIDATES
# logits whenever they already hold the top_p mass (then no full-vocabulary sort is needed).
TOP_P_CANDIDATES = 256


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept), the rest -inf.

    k <= 0 or k >= V disables the filter."""
    V = logits.shape[-1]
    if k <= 0 or k >= V:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of highest-probability tokens whose mass reaches p.

    A token is kept if the probability mass of the tokens strictly ahead of it (in descending order)
    is < p, so the top token is always kept. p >= 1 disables the filter.
    """
    if p >= 1.0:
        return logits
    if p <= 0.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    B, V = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # (B, V)
    n = min(V, TOP_P_CANDIDATES)
    top_probs, top_idx = torch.topk(probs, n, dim=-1)  # (B, n), descending
    if n < V and bool((top_probs.sum(-1) < p).any()):
        top_probs, top_idx = torch.sort(probs, dim=-1, descending=True)  # rare: need the full order
    mass_before = top_probs.cumsum(-1) - top_probs  # (B, n) mass strictly ahead of each token
    keep_sorted = mass_before < p
    keep = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, top_idx, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The log-space sampling distribution before normalisation: filter(logits / temperature) in fp32."""
    return top_p_filter(top_k_filter(tempered(logits, temperature), top_k), top_p)


def row_uniforms(generators: list[torch.Generator] | None, batch: int, device) -> torch.Tensor:
    """(B, 1) float64 uniforms in [0, 1); row b from generators[b] (one draw), or the global RNG.

    Drawn in float32 (24-bit) and widened, so u * total < total holds exactly in float64."""
    if generators is None:
        return torch.rand(batch, 1, device=device).double()
    if len(generators) != batch:
        raise ValueError(f"need one generator per row: {len(generators)} generators for {batch} rows")
    return torch.cat([torch.rand(1, generator=g, device=device) for g in generators]).double()[:, None]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax tokens (B,) and their log_softmax(logits) log-probs (B,)."""
    tokens = logits.argmax(dim=-1)
    return tokens, token_logprobs(logits, tokens)


def sample(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generators: list[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns tokens (B,) int64 and log pi(token) (B,) fp32.

    temperature == 0 is greedy (see `greedy`). Otherwise pi = softmax(filter_logits(...)), drawn by
    inverting its CDF with one uniform per row from generators[b] (None: the global RNG).
    """
    if temperature == 0:
        return greedy(logits)
    scores = filter_logits(logits, temperature, top_k, top_p)  # (B, V), -inf where filtered
    B, V = scores.shape
    top = scores.amax(dim=-1, keepdim=True)  # (B, 1)
    cdf = torch.exp(scores - top).cumsum(dim=-1, dtype=torch.float64)  # (B, V); flat over filtered tokens
    total = cdf[:, -1:]  # (B, 1) = sum of exp(scores - top)
    u = row_uniforms(generators, B, scores.device)  # (B, 1)
    # first index whose cumulative weight exceeds u * total: never a zero-weight (filtered) token
    tokens = torch.searchsorted(cdf, u * total, right=True)[:, 0].clamp_(max=V - 1)  # (B,)
    return tokens, token_logprobs(scores, tokens)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    """Most tokens generated per request (the EOS token, if sampled, counts)."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""
    stop: tuple[str, ...] = ()
    """Stop strings (need a tokenizer): generation stops once the new text contains one."""
    ignore_eos: bool = False
    """Do not stop on EOS (benchmarks that must produce exactly max_new_tokens per request)."""

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
