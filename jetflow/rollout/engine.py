"""The native rollout engine: batched prefill + decode over a preallocated KV cache.

    engine = RolloutEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                           max_batch=16, max_seq_len=512, tokenizer=tok)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=128, temperature=1.0), seeds=[...])
    out.token_ids[i], out.logprobs[i], out.finish_reasons[i], out.weight_version

How a batch runs (continuous batching over a paged KV cache, jetflow.rollout.scheduler):
- The KV cache is a pool of 64-position pages (jetflow.model.paged_cache) sized by a byte budget
  (`kv_cache_bytes`), in the precision's bytes: E4M3 codes when an FP8 K/V quantizer is attached and
  calibrated (one byte a value), else the cache dtype. A request holds ceil(positions / 64) pages; a
  finished request's pages return to the pool at once.
- At most `max_batch` requests decode together. A waiting request starts at the next step once a row
  and its prompt's pages are free: its prefill runs as one call (with the other requests admitted at
  that step, right-padded), beside the running rows' decode steps. With `continuous=False`, requests
  are admitted only into an empty batch (static batches, the engine's old behaviour).
- A request's token at position p lives in its own page table[p // 64] at offset p % 64 (slot =
  position): every request sees exactly the slots it would see alone, the layout exact numerics
  needs. Only each request's last prompt position goes through lm_head.
- When a running row needs a new page and the pool is empty, the youngest request is preempted: its
  pages are freed and it is recomputed later from its prompt, its sampler restarted from its seed, so
  it produces the same tokens (never an out-of-memory error). A request stops on one of its EOS ids,
  on a stop string (checked on the decoded tail of its new tokens), or at max_new_tokens.

A request needs len(prompt) + max_new_tokens <= max_seq_len positions and must fit the pool alone
(checked before any work is done).

Numerics: the engine calls the model's own modules (`forward_hidden`, then `lm_head`), so whatever
precision converter was applied to the model (fp32 / bf16 / FP8 recipe linears) is what rollout
runs: the rollout policy is the model's policy. Log-probs are those of the sampling distribution,
computed by the function the trainer uses (`jetflow.model.logprobs.token_logprobs`). Under exact
numerics (`model.numerics == "exact"`) every row is computed by the batch-invariant kernels, so the
rollout log-probs equal the trainer's full-forward log-probs bit for bit. Under fast numerics, for
speed on the CPU, plain fp32 linears run on oneDNN-prepacked copies of their weights (same
products, fp32 accumulation, ~1e-6 apart; `jetflow.rollout.cpu_pack`).

Speed on the CPU: a decode step is mostly GEMMs of a few rows, the same GEMMs every fp32
implementation runs, so the margin over HF generate() comes from running them on prepacked weights
and from what surrounds them: no growing cache copies, lm_head on the last position only, one random
number per row for sampling, and finished rows leaving the batch. The measurements: results/bench and
results/kv-cache-long.
"""

from __future__ import annotations

import resource
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from jetflow.model.moe import moe_blocks
from jetflow.model.paged_cache import PagePool
from jetflow.rollout.cpu_pack import PackedLinears
from jetflow.rollout.parked import Turns
from jetflow.rollout.sampling import SamplingParams, sample
from jetflow.rollout.scheduler import Scheduler, Sequence, pages_for
from jetflow.rollout.stop import final_text, hits_stop, stop_window

FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class RolloutOutput:
    """One generate() call. Every list has one entry per request, in the order of the prompts."""

    prompt_ids: list[list[int]]
    """The prompts as given (no padding)."""
    token_ids: list[list[int]]
    """Generated tokens only; ends with the EOS token if the request stopped on one."""
    logprobs: list[list[float]]
    """log pi_rollout(token) for each generated token: log_softmax(filter(logits / temperature)),
    top-k / top-p filtered and renormalised; under greedy, log_softmax(logits)."""
    finish_reasons: list[str]
    """"eos" | "stop" | "length"."""
    texts: list[str] | None
    """Decoded token_ids (special tokens skipped, text cut before the stop string on "stop");
    None without a tokenizer."""
    weight_version: int
    """The engine's weight_version when this call started (which policy produced the tokens)."""
    stats: dict = field(default_factory=dict)
    """prefill_s, decode_s, new_tokens, tokens_per_s, ..."""
    token_masks: list[list[int]] | None = None
    """Conversations (`on_turn_end`): per request 1 on each token the engine sampled, 0 on each observation
    token appended between turns (their logprobs entries are 0.0 and mean nothing); None for one turn."""
    routed_experts: list[torch.Tensor] | None = None
    """With `record_routing`: per request the expert ids each MoE layer chose at every position the
    engine ran, (len(prompt) + len(tokens) - 1, L_moe, K) int16 (the last sampled token is never fed
    back); the trainer replays them (`Decoder.forward_hidden(routed_experts=...)`)."""
    token_versions: list[list[int]] | None = None
    """Per request the weight version that computed each generated token's distribution (one request spans two
    after an in-flight update: `start` / `resume`); None for conversations."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class _Request:
    index: int  # position in the caller's list
    prompt: list[int]
    generator: torch.Generator | None
    seed: int
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    routing: list[torch.Tensor] = field(default_factory=list)  # (n, L_moe, K) per forward that ran it
    mask: list[int] = field(default_factory=list)  # conversations: 1 on a sampled token, 0 on an observation's
    turn_start: int = 0  # the current turn's first index in tokens
    pending: Future | None = None  # conversations: the observation its last turn is waiting for
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each of its tokens

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def restart(self) -> None:
        """Preempted: forget its tokens and restart its sampler, so the recomputation draws the same."""
        self.tokens, self.logprobs, self.routing, self.versions, self.finish_reason = [], [], [], [], None
        if self.generator is not None:
            self.generator.manual_seed(self.seed)


@dataclass
class _Generation:
    """One generate()'s state: kept between start() and resume() while its batch waits for new weights."""
    requests: list[_Request]
    sched: Scheduler
    params: SamplingParams
    stats: dict
    version: int  # the weights it started under (RolloutOutput.weight_version)
    conversations: bool


def kv_pool_pages(requests: int, positions: int) -> int:
    """Pages of a pool that holds `requests` requests of `positions` positions each: ceil(positions / 64)
    pages a request (pages_for), and the null page (PagePool)."""
    return requests * pages_for(positions) + 1


def default_kv_pool_bytes(config, max_batch: int, max_seq_len: int) -> int:
    """The page pool's budget when RolloutEngine is given none (kv_cache_bytes=None): room for max_batch
    requests of max_seq_len positions at fp32 (the old dense cache's size), and the null page."""
    c = config
    return kv_pool_pages(max_batch, max_seq_len) * PagePool.page_bytes(c.num_layers, c.num_kv_heads, c.head_dim,
                                                                       torch.float32)


class RolloutEngine:
    """Batched generation with continuous batching over a paged KV cache, per-request seeds and rollout
    log-probs.

    eos_token_ids: every id that ends a request (empty: only stop strings / length end it).
    pad_token_id: fills the right padding of a prefill (never attended to by a real token).
    max_batch: most requests decoding at once. max_seq_len: a request needs len(prompt) +
        max_new_tokens <= max_seq_len positions.
    kv_cache_bytes: the page pool's budget in bytes (one buffer, mapped by the OS as pages are first
        used); None: room for max_batch requests of max_seq_len positions at fp32 (default_kv_pool_bytes).
    cache_dtype: dtype of the pages when they do not hold FP8 codes (default: the model's embedding dtype).
    fp8_pages: store E4M3 codes when the model has a calibrated FP8 K/V quantizer attached
        (jetflow.precision.kv; the same values as its rounded fp32, a quarter of the bytes); False: pages
        of cache_dtype holding the rounded values.
    continuous: admit a waiting request as soon as a row and its pages are free; False: only into an
        empty batch (static batches, to compare against).
    tokenizer: needed for stop strings and `texts` (encode / decode).
    compile: torch.compile the decode step's forward (see `_compiled_hidden`).
    pack_linears: on the CPU, run plain fp32 linears on oneDNN-prepacked weight copies (one more
        fp32 copy of those weights; `jetflow.rollout.cpu_pack`); ignored with compile.
    record_routing: MoE models: keep every MoE layer's expert choice at every position (prefill and
        each decode step) and return it as `RolloutOutput.routed_experts`, for routing replay.

    `weight_version` is set by whoever loads new weights into `model` (e.g. the trainer -> rollout
    sync); every output carries the version it was generated with.
    """

    def __init__(self, model, eos_token_ids: list[int], pad_token_id: int, max_batch: int, max_seq_len: int,
                 device: str | torch.device = "cpu", cache_dtype: torch.dtype | None = None, tokenizer=None,
                 kv_cache_bytes: int | None = None, fp8_pages: bool = True, continuous: bool = True,
                 compile: bool = False, pack_linears: bool = True, record_routing: bool = False):
        if max_batch < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch >= 1 and max_seq_len >= 2, got {max_batch}, {max_seq_len}")
        if eos_token_ids is None:
            eos_token_ids = []
        elif isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.fp8_pages, self.continuous = fp8_pages, continuous
        self.weight_version = 0
        self._paused: _Generation | None = None  # a batch start() paused for a weight update
        self.last_stats: dict = {}
        self.vocab_size = model.config.vocab_size
        self._rss_start = _max_rss_bytes()
        self.cache_dtype = cache_dtype or model.model.embed_tokens.weight.dtype
        if kv_cache_bytes is None:
            kv_cache_bytes = default_kv_pool_bytes(model.config, max_batch, max_seq_len)
        self.kv_pool_bytes = int(kv_cache_bytes)  # the budget
        # the pages' memory (on the CPU mapped by the OS as pages are first used)
        self._kv_buffer = torch.empty(self.kv_pool_bytes, dtype=torch.uint8, device=self.device)
        self.pool: PagePool | None = None  # the last generate's pool (its dtype follows the FP8 K/V quantizer)
        self._moe = moe_blocks(model) if record_routing else []
        if record_routing and not self._moe:
            raise ValueError("record_routing=True: the model has no mixture-of-experts layers")
        if record_routing and compile:
            raise ValueError("record_routing=True reads each MoE block's choice after every step: not with compile=True")
        if compile and model.numerics == "exact":
            raise ValueError("compile=True is for fast numerics; the exact kernels are already compiled C++")
        # prepacked CPU weights (not with compile: the compiled graph keeps ATen's linears)
        self._packed = (PackedLinears(model, max_batch) if pack_linears and not compile and self.device.type == "cpu"
                        and PackedLinears.available() else None)
        # the decode step's forward_hidden: torch.compile'd if asked (prefill always runs eager)
        self._decode_hidden = self._compiled_hidden() if compile else model.forward_hidden

    # ------------------------------------------------------------------------------------------
    # public API

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 seeds: list[int] | None = None, max_new_tokens: list[int] | None = None,
                 on_turn_end: Callable[[int, list[int], str], Future | None] | None = None,
                 max_total_tokens: int | None = None, reprefill_turns: bool = False) -> RolloutOutput:
        """Generate for every prompt (token ids). `seeds[i]` seeds request i's own generator, so a
        request reproduces whatever else is in the batch; None draws seeds from torch's global RNG.
        `max_new_tokens[i]` (optional, at most params.max_new_tokens) caps request i's own length.

        Conversations (multi-turn, token in, token out): with `on_turn_end`, a request whose turn ends on
        EOS or a stop string is handed over as `on_turn_end(i, turn_ids, reason)`, which returns None (the
        conversation is over) or a Future of the observation's token ids (None: over). While it waits its
        pages stay held and the others decode; once the ids come they are appended to the same sequence
        (only they are prefilled: the prefix's K/V stay in the pages) and the next turn is sampled, up to
        max_new_tokens a turn. A conversation ends with "length" when a turn reaches max_new_tokens or the
        whole (prompt, turns, observations) would pass `max_total_tokens`; a preempted conversation is
        recomputed from its whole context, its sampler going on where it was. `reprefill_turns` (to measure
        what page reuse saves): each turn starts by prefilling the whole conversation again, pages freed."""
        gen = self._open(prompts, params, seeds, max_new_tokens, on_turn_end, max_total_tokens, reprefill_turns)
        self._run(gen)
        return self._close(gen)

    def start(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
              pause_at: int) -> RolloutOutput | None:
        """generate() of one-turn requests up to `pause_at` decode steps of the batch: its output when it ends
        before, else None, the batch kept (pages held, each running request's last token sampled, not yet fed) for
        `resume` once new weights are loaded (in-flight weight updates, jetflow.run.inflight). No other generate
        may run meanwhile (the batch holds the page pool)."""
        gen = self._open(prompts, params, seeds)
        if self._run(gen, until=pause_at):
            return self._close(gen)
        self._paused = gen
        return None

    def resume(self, reprefill: bool) -> RolloutOutput:
        """Finish the batch `start` paused, under the weights loaded since (its tokens from here on tagged with
        the new weight_version). `reprefill`: every running request leaves the batch, its pages freed, and is
        recomputed from its first position under the new weights (its next token is then sampled from the new
        policy given its prefix, exactly); else its K/V pages, computed under the old weights, are kept (cheaper;
        the tokens after the swap then come from no single version's policy). stats["swap_prefill_tokens"]: the
        positions recomputed."""
        gen, self._paused = self._paused, None
        if gen is None:
            raise RuntimeError("resume() without a batch paused by start()")
        recomputed = gen.sched.recompute_running() if reprefill and self.weight_version != gen.version else []
        gen.stats["swap_prefill_tokens"] = sum(s.request.context_len for s in recomputed)
        for s in recomputed:
            s.prompt_len = s.request.context_len  # its prompt and every token sampled (the last one not yet fed)
        self._run(gen)
        return self._close(gen)

    def _open(self, prompts: list[list[int]], params: SamplingParams | None, seeds: list[int] | None,
              max_new_tokens: list[int] | None = None,
              on_turn_end: Callable[[int, list[int], str], Future | None] | None = None,
              max_total_tokens: int | None = None, reprefill_turns: bool = False) -> "_Generation":
        """A generate()'s requests checked and queued."""
        if self._paused is not None:
            raise RuntimeError("a batch is paused for a weight update (start): resume() it first")
        params = params or SamplingParams()
        conversations = on_turn_end is not None
        total = max_total_tokens if conversations and max_total_tokens else None
        caps = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else [int(n) for n in max_new_tokens]
        if len(caps) != len(prompts) or not all(1 <= n <= params.max_new_tokens for n in caps):
            raise ValueError(f"max_new_tokens: one value in [1, {params.max_new_tokens}] per prompt")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: RolloutEngine(..., tokenizer=...)")
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        pool = self._new_pool()
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            need = total if total is not None else len(p) + params.max_new_tokens
            if total is not None and len(p) >= total:
                raise ValueError(f"request {i}: its {len(p)}-token prompt leaves no room in max_total_tokens={total}")
            if need > self.max_seq_len:
                raise ValueError(
                    f"request {i} needs {len(p)} prompt + {params.max_new_tokens} new tokens = "
                    f"{need} slots > max_seq_len={self.max_seq_len} of this engine" if total is None else
                    f"conversation {i} may take max_total_tokens={total} slots > max_seq_len={self.max_seq_len} "
                    "of this engine")
            if pages_for(need) > pool.num_pages:
                raise ValueError(f"request {i} needs {pages_for(need)} KV pages of 64 "
                                 f"positions; the {self.kv_pool_bytes}-byte pool holds {pool.num_pages} "
                                 f"({pool.dtype}): raise the KV cache budget")
        if conversations and self._moe:
            raise ValueError("record_routing (routing replay) is not built for conversations (on_turn_end)")
        version = self.weight_version
        requests = [
            _Request(i, list(map(int, p)),
                     torch.Generator(self.device).manual_seed(int(s)) if params.temperature > 0 else None, int(s), n)
            for i, (p, s, n) in enumerate(zip(prompts, seeds, caps))
        ]
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "prefills": 0, "prefill_tokens": 0}
        sched = Scheduler(pool, self.max_batch, self.continuous)
        sched.add([Sequence(len(r.prompt), r) for r in requests])
        self._turns = Turns(on_turn_end, total, reprefill_turns) if on_turn_end is not None else None
        return _Generation(requests, sched, params, stats, version, conversations)

    def _run(self, gen: "_Generation", until: int | None = None) -> bool:
        """Prefill and decode until the batch is done (True) or has taken `until` decode steps (False)."""
        sched, params, stats = gen.sched, gen.params, gen.stats
        with torch.inference_mode(), self._packed.applied(self.weight_version) if self._packed else nullcontext():
            while not sched.done or (self._turns is not None and self._turns.parked):
                if until is not None and stats["decode_steps"] >= until:
                    return False
                if self._turns is not None:
                    self._turns.resume_ready(sched, block=not sched.running and not sched.waiting)
                new = sched.admit()
                if self._turns is not None and not new and not sched.running and sched.waiting:
                    sched.evict_idle(self._turns.parked)  # every free page is held by waiting conversations
                    new = sched.admit()
                if new:
                    self._prefill(new, params, sched, stats)
                for s in sched.grow():  # preempted: recomputed later (a conversation from its whole context)
                    if self._turns is None:
                        s.request.restart()
                        s.prompt_len = len(s.request.prompt)  # (an in-flight update's re-prefill had set more)
                    else:
                        s.prompt_len = s.request.context_len
                if sched.running:
                    self._decode_step(sched, params, stats)
        return True

    def _close(self, gen: "_Generation") -> RolloutOutput:
        """The finished batch's output."""
        requests, sched, params, stats, conversations = gen.requests, gen.sched, gen.params, gen.stats, gen.conversations
        pool = sched.pool
        self._turns = None
        self.pool = pool
        new_tokens = sum(sum(r.mask) if conversations else len(r.tokens) for r in requests)  # sampled, not observed
        elapsed = stats["prefill_s"] + stats["decode_s"]
        stats.update(new_tokens=new_tokens, tokens_per_s=new_tokens / elapsed if elapsed > 0 else 0.0,
                     preemptions=sched.preemptions, kv_pages_peak=pool.peak_held)
        self.last_stats = stats  # the last generate's, for the benches (RolloutOutput.stats is the same dict)
        texts = None
        if self.tokenizer is not None:
            texts = [final_text(self.tokenizer, r.tokens, params.stop, r.finish_reason == "stop") for r in requests]
        return RolloutOutput(
            prompt_ids=[r.prompt for r in requests],
            token_ids=[r.tokens for r in requests],
            logprobs=[r.logprobs for r in requests],
            finish_reasons=[r.finish_reason for r in requests],
            texts=texts,
            weight_version=gen.version,
            stats=stats,
            token_masks=[r.mask for r in requests] if conversations else None,
            routed_experts=[torch.cat(r.routing) for r in requests] if self._moe else None,
            token_versions=None if conversations else [r.versions for r in requests],
        )

    def kv_page_dtype(self) -> torch.dtype:
        """What the pages hold in the next generate: the attached K/V rounding's own dtype once it applies
        (E4M3 codes under a calibrated FP8 quantizer, unless fp8_pages is off; bf16 under the bf16 mode's
        rounding), else cache_dtype."""
        quantizer = self.model.model.layers[0].self_attn.kv_quantizer
        if quantizer is None or not quantizer.ready:
            return self.cache_dtype
        if quantizer.page_dtype == torch.float8_e4m3fn and not self.fp8_pages:
            return self.cache_dtype
        return quantizer.page_dtype

    def _new_pool(self) -> PagePool:
        return PagePool.for_budget(self.model.config, self.kv_pool_bytes, self.kv_page_dtype(),
                                   exact=self.model.numerics == "exact", buffer=self._kv_buffer)

    def memory_stats(self) -> dict:
        """Memory for the bench. kv_cache_bytes: the peak bytes of pages held by requests during the last
        generate (0 before one); kv_pool_bytes: the pool's budget; kv_bytes_per_token: one position of K
        and V over every layer in the pages' dtype; model bytes; the prepacked weight copies; CUDA peak
        allocation on GPU; on the CPU the growth of the process's peak RSS since this engine was built (a
        high-water mark: 0 means the process had already been that large before)."""
        pool = self.pool or self._new_pool()
        kv = pool.peak_held * pool.bytes_per_page if self.pool is not None else 0
        seen, model_bytes = set(), 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.data_ptr() not in seen:  # tied weights counted once
                seen.add(t.data_ptr())
                model_bytes += t.numel() * t.element_size()
        packed = self._packed.packed_bytes() if self._packed else 0  # the prepacked weight copies
        out = {"kv_cache_bytes": kv, "kv_pool_bytes": self.kv_pool_bytes, "kv_bytes_per_token": pool.bytes_per_token,
                "kv_page_dtype": str(pool.dtype).replace("torch.", ""), "kv_pool_pages": pool.num_pages,
                "model_bytes": model_bytes, "packed_weight_bytes": packed}
        if self.device.type == "cuda":
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            out["peak_memory_bytes"] = kv + model_bytes + packed
            out["max_rss_delta_bytes"] = max(0, _max_rss_bytes() - self._rss_start)
        return out

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory_stats()["peak_memory_bytes"]

    # ------------------------------------------------------------------------------------------
    # one step: a prefill of the admitted requests, a decode step of the running ones

    def _prefill(self, seqs: list[Sequence], params: SamplingParams, sched: Scheduler, stats: dict) -> None:
        """One forward over the admitted prompts (right-padded; padding writes only the null page or the
        row's own unused slots), then each request's first token."""
        t0, dev = time.perf_counter(), self.device
        B = len(seqs)
        lens = torch.tensor([s.prompt_len for s in seqs], device=dev)  # (B,)
        P = int(lens.max())
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)  # (B, P), right-padded
        for b, s in enumerate(seqs):  # the prompt, or a conversation's tokens past those its pages hold
            ids[b, :s.prompt_len] = torch.tensor((s.request.prompt + s.request.tokens)[s.written:s.written + s.prompt_len])
        starts = torch.tensor([s.written for s in seqs], device=dev)  # (B,) 0 but for a conversation's next turn
        cache = sched.pool.view(self._table(seqs, pages_for(int(starts.max()) + P), sched.pool))
        positions = starts[:, None] + torch.arange(P, device=dev)  # (B, P) slot = position
        h = self.model.forward_hidden(ids.to(dev), position_ids=positions, cache=cache)  # (B, P, C)
        logits = self.model.lm_head(h[torch.arange(B, device=dev), lens - 1])  # (B, V): each last prompt token
        if self._moe:
            routing = self._routing(B, P)  # (B, P, L, K)
            for b, s in enumerate(seqs):
                s.request.routing.append(routing[b, :s.prompt_len])
        for s in seqs:
            s.written += s.prompt_len
        stats["prefill_s"] += _elapsed(t0, dev)
        stats["prefills"] += 1
        stats["prefill_tokens"] += int(lens.sum())
        self._sample(seqs, logits, params, sched)

    def _decode_step(self, sched: Scheduler, params: SamplingParams, stats: dict) -> None:
        t0, dev = time.perf_counter(), self.device
        seqs = list(sched.running)
        tokens = torch.tensor([s.request.tokens[-1] for s in seqs], device=dev)[:, None]  # (B, 1)
        pos = torch.tensor([s.next_position for s in seqs], device=dev)[:, None]  # (B, 1)
        cache = sched.pool.view(self._table(seqs, max(len(s.pages) for s in seqs), sched.pool))
        h = self._decode_hidden(tokens, position_ids=pos, cache=cache)  # (B, 1, C)
        logits = self.model.lm_head(h[:, -1])  # (B, V)
        if self._moe:
            routing = self._routing(len(seqs), 1)  # (B, 1, L, K)
            for b, s in enumerate(seqs):
                s.request.routing.append(routing[b])
        for s in seqs:
            s.written += 1
        stats["decode_steps"] += 1
        stats["decode_s"] += _elapsed(t0, dev)
        self._sample(seqs, logits, params, sched)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, params: SamplingParams, sched: Scheduler) -> None:
        """Each row's next token from its own generator; finished requests leave the batch."""
        gens = [s.request.generator for s in seqs] if params.temperature > 0 else None
        tokens, logprobs = sample(logits, params.temperature, params.top_k, params.top_p, gens)  # (B,), (B,)
        window = stop_window(params.stop)
        turns = self._turns
        for s, t, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            r = s.request
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.weight_version)
            if turns is not None:
                r.mask.append(1)
            if t in self.eos_token_ids and not params.ignore_eos:
                r.finish_reason = "eos"
            elif window and hits_stop(self.tokenizer, r.tokens[r.turn_start:], params.stop, window):
                r.finish_reason = "stop"
            elif len(r.tokens) - r.turn_start >= r.max_new_tokens:
                r.finish_reason = "length"
            elif turns is not None and turns.total is not None and r.context_len >= turns.total:
                r.finish_reason = "length"  # the conversation's whole budget
            if r.finish_reason is None:
                continue
            if turns is not None and r.finish_reason != "length" and turns.turn_ended(s, sched):
                continue  # waiting for its observation, its pages held
            sched.retire(s)

    @staticmethod
    def _table(seqs: list[Sequence], width: int, pool: PagePool) -> torch.Tensor:
        """The rows' block tables, (B, width) int32; past a row's pages: the null page."""
        table = torch.full((len(seqs), width), pool.null_page, dtype=torch.int32)
        for b, s in enumerate(seqs):
            table[b, :len(s.pages)] = torch.tensor(s.pages[:width], dtype=torch.int32)
        return table

    def _routing(self, B: int, T: int) -> torch.Tensor:
        """The last forward's expert ids of every MoE layer, (B, T, L_moe, K) int16 on the CPU."""
        return torch.stack([blk.last_topk_ids.view(B, T, -1) for blk in self._moe], dim=2).to("cpu", torch.int16)

    def _compiled_hidden(self):
        """torch.compile of the model's forward_hidden for the decode step (optional; the decoder
        code itself is untouched).

        dynamic=True: the cache length grows by one every step and compaction shrinks the batch, so
        a static-shape graph would recompile at every step; one dynamic graph serves them all (two:
        with and without an attention mask). It fuses the element-wise work between the GEMMs
        (norms, RoPE, SwiGLU); the GEMMs themselves stay ATen's. The first call compiles (tens of
        seconds on a CPU)."""
        return torch.compile(self.model.forward_hidden, mode="default", dynamic=True)


def _elapsed(t0: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
