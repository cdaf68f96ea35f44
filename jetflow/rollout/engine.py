"""The native rollout engine: batched prefill + decode over a preallocated KV cache.

    engine = RolloutEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                           max_batch=16, max_seq_len=512, tokenizer=tok)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=128, temperature=1.0), seeds=[...])
    out.token_ids[i], out.logprobs[i], out.finish_reason[i], out.weight_version

How a batch runs:
- At most `max_batch` requests decode together; more are processed in chunks of `max_batch`.
- Prompts are right-padded to the longest prompt of the chunk, and a request's token at position p
  lives in KV slot p: every request starts at slot 0 and sees exactly the slots it would see alone
  (the layout exact numerics needs: attention's reduction order then never depends on the batch).
- Prefill runs the whole (B, P) block once; only each request's last prompt position goes through
  lm_head.
- Each decode step feeds the B sampled tokens (B, 1), each at its own position (written to its own
  slot). A request stops on one of its EOS ids, on a stop string (checked on the decoded tail of its
  new tokens), or at max_new_tokens.
- Finished rows are dropped from the batch (and their KV rows from the cache, via index_select)
  once at least `compact_fraction` of the rows are done, so a long tail of unfinished requests does
  not pay for the finished ones. The loop ends as soon as every row is done.

The KV cache is allocated once, (max_batch, max_seq_len) per layer, when the engine is built; each
chunk uses views of its first rows, so memory never grows with the requests. A request needs
len(prompt) + max_new_tokens <= max_seq_len slots (checked before any work is done).

Numerics: the engine calls the model's own modules (`forward_hidden`, then `lm_head`), so whatever
precision converter was applied to the model (fp32 / bf16 / FP8 recipe linears) is what rollout
runs: the rollout policy is the model's policy. Log-probs are those of the sampling distribution,
computed by the function the trainer uses (`jetflow.model.logprobs.token_logprobs`). Under exact
numerics (`model.numerics == "exact"`) every row is computed by the batch-invariant kernels, so the
rollout log-probs equal the trainer's full-forward log-probs bit for bit. Under fast numerics, for
speed on the CPU, plain fp32 linears run on oneDNN-prepacked copies of their weights (same
products, fp32 accumulation, ~1e-6 apart; `jetflow.rollout.cpu_pack`).

Speed on the CPU (SmolLM2-135M fp32, batch 16, 64 + 128 tokens, 2 cores): a decode step is ~90% GEMM
at M = 16 rows, the same GEMMs every fp32 implementation runs, so the margin over HF generate()
comes from running them on prepacked weights and from what surrounds them: no growing cache
copies, lm_head on the last position only, one random number per row for sampling, and finished
rows dropped. See results/bench.
"""

from __future__ import annotations

import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from jetflow.model.kv_cache import KVCache
from jetflow.model.moe import moe_blocks
from jetflow.rollout.cpu_pack import PackedLinears
from jetflow.rollout.sampling import sample

FINISH_REASONS = ("eos", "stop", "length")


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
    finish_reason: list[str]
    """"eos" | "stop" | "length"."""
    text: list[str] | None
    """Decoded token_ids (special tokens skipped, text cut before the stop string on "stop");
    None without a tokenizer."""
    weight_version: int
    """The engine's weight_version when this call started (which policy produced the tokens)."""
    stats: dict = field(default_factory=dict)
    """prefill_s, decode_s, new_tokens, tokens_per_s, ..."""
    routed_experts: list[torch.Tensor] | None = None
    """With `record_routing`: per request the expert ids each MoE layer chose at every position the
    engine ran, (len(prompt) + len(tokens) - 1, L_moe, K) int16 (the last sampled token is never fed
    back); the trainer replays them (`Decoder.forward_hidden(routed_experts=...)`)."""

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class _Request:
    index: int  # position in the caller's list
    prompt: list[int]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    routing: list[torch.Tensor] = field(default_factory=list)  # (n, L_moe, K) per forward that ran it


class RolloutEngine:
    """Batched generation with a preallocated KV cache, per-request seeds and rollout log-probs.

    eos_token_ids: every id that ends a request (empty: only stop strings / length end it).
    pad_token_id: fills the left padding (masked out, never attended to).
    max_batch, max_seq_len: size of the KV cache, allocated here once; a request needs
        len(prompt) + max_new_tokens <= max_seq_len.
    cache_dtype: KV cache dtype (default: the model's embedding dtype).
    tokenizer: needed for stop strings and `text` (encode / decode).
    compact_fraction: drop finished rows from the batch once this fraction of it is done (0: at
        every finish; >= 1: never, the chunk just ends when all rows are done).
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
                 compact_fraction: float = 0.25, compile: bool = False, pack_linears: bool = True,
                 record_routing: bool = False):
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
        self.compact_fraction = compact_fraction
        self.weight_version = 0
        self.vocab_size = model.config.vocab_size
        self._rss_start = _max_rss_bytes()
        # the one KV cache: (max_batch, H_kv, max_seq_len, D) per layer; chunks use views of it
        self.cache: KVCache = model.new_cache(max_batch, max_seq_len, cache_dtype, self.device)
        self._moe = moe_blocks(model) if record_routing else []
        if record_routing and not self._moe:
            raise ValueError("record_routing=True: the model has no mixture-of-experts layers")
        if record_routing and compile:
            raise ValueError("record_routing=True reads each MoE block's choice after every step: not with compile=True")
        if compile and getattr(model, "numerics", "fast") == "exact":
            raise ValueError("compile=True is for fast numerics; the exact kernels are already compiled C++")
        # prepacked CPU weights (not with compile: the compiled graph keeps ATen's linears)
        self._packed = (PackedLinears(model, max_batch) if pack_linears and not compile and self.device.type == "cpu"
                        and PackedLinears.available() else None)
        # the decode step's forward_hidden: torch.compile'd if asked (prefill always runs eager)
        self._decode_hidden = self._compiled_hidden() if compile else model.forward_hidden

    # ------------------------------------------------------------------------------------------
    # public API

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 seeds: list[int] | None = None) -> RolloutOutput:
        """Generate for every prompt (token ids). `seeds[i]` seeds request i's own generator, so a
        request reproduces whatever else is in the batch; None draws seeds from torch's global RNG."""
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: RolloutEngine(..., tokenizer=...)")
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + params.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"request {i} needs {len(p)} prompt + {params.max_new_tokens} new tokens = "
                    f"{len(p) + params.max_new_tokens} slots > max_seq_len={self.max_seq_len} of this engine")
        version = self.weight_version
        requests = [
            _Request(i, list(map(int, p)),
                     torch.Generator(self.device).manual_seed(int(s)) if params.temperature > 0 else None)
            for i, (p, s) in enumerate(zip(prompts, seeds))
        ]
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "compactions": 0}
        # long prompts together: less padding per chunk (outputs are returned in the caller's order)
        order = sorted(requests, key=lambda r: len(r.prompt), reverse=True)
        with torch.inference_mode(), self._packed.applied(version) if self._packed else nullcontext():
            for start in range(0, len(order), self.max_batch):
                self._run_chunk(order[start:start + self.max_batch], params, stats)
        new_tokens = sum(len(r.tokens) for r in requests)
        elapsed = stats["prefill_s"] + stats["decode_s"]
        stats.update(new_tokens=new_tokens, tokens_per_s=new_tokens / elapsed if elapsed > 0 else 0.0)
        text = None
        if self.tokenizer is not None:
            text = [self._final_text(r, params.stop) for r in requests]
        return RolloutOutput(
            prompt_ids=[r.prompt for r in requests],
            token_ids=[r.tokens for r in requests],
            logprobs=[r.logprobs for r in requests],
            finish_reason=[r.finish_reason for r in requests],
            text=text,
            weight_version=version,
            stats=stats,
            routed_experts=[torch.cat(r.routing) for r in requests] if self._moe else None,
        )

    def memory_stats(self) -> dict:
        """Memory for the bench: KV cache and model bytes; CUDA peak allocation on GPU; on the CPU
        the growth of the process's peak RSS since this engine was built (a high-water mark: 0 means
        the process had already been that large before)."""
        kv = sum(t.numel() * t.element_size() for t in self.cache.k + self.cache.v)
        seen, model_bytes = set(), 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.data_ptr() not in seen:  # tied weights counted once
                seen.add(t.data_ptr())
                model_bytes += t.numel() * t.element_size()
        packed = self._packed.packed_bytes() if self._packed else 0  # the prepacked weight copies
        out = {"kv_cache_bytes": kv, "model_bytes": model_bytes, "packed_weight_bytes": packed}
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
    # one chunk of at most max_batch requests

    def _run_chunk(self, reqs: list[_Request], params: SamplingParams, stats: dict) -> None:
        B, dev = len(reqs), self.device
        lens = torch.tensor([len(r.prompt) for r in reqs], device=dev)  # (B,)
        P = int(lens.max())
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)  # (B, P), right-padded
        for b, r in enumerate(reqs):
            ids[b, :len(r.prompt)] = torch.tensor(r.prompt)
        ids = ids.to(dev)

        t0 = time.perf_counter()
        cache = self.cache.view(B, 0)
        positions = torch.arange(P, device=dev).expand(B, P)  # slot = position
        h = self.model.forward_hidden(ids, position_ids=positions, cache=cache)  # (B, P, C), eager
        logits = self.model.lm_head(h[torch.arange(B, device=dev), lens - 1])  # (B, V): each last prompt token
        if self._moe:
            routing = self._routing(B, P)  # (B, P, L, K)
            for b, r in enumerate(reqs):
                r.routing.append(routing[b, :len(r.prompt)])
        stats["prefill_s"] += _elapsed(t0, dev)

        t0 = time.perf_counter()
        rows = list(reqs)  # the request in each row of the running batch
        done = [False] * B
        next_pos = lens  # (B,) position (= KV slot) of each row's next token
        stop_window = self._stop_window(params.stop)
        while True:
            gens = [r.generator for r in rows] if params.temperature > 0 else None
            tokens, logprobs = sample(logits, params.temperature, params.top_k, params.top_p, gens)  # (B,), (B,)
            n_done = 0
            for b, (r, t, lp) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist())):
                if done[b]:
                    n_done += 1
                    continue
                r.tokens.append(t)
                r.logprobs.append(lp)
                if t in self.eos_token_ids and not params.ignore_eos:
                    r.finish_reason = "eos"
                elif stop_window and self._hits_stop(r.tokens, params.stop, stop_window):
                    r.finish_reason = "stop"
                elif len(r.tokens) >= params.max_new_tokens:
                    r.finish_reason = "length"
                if r.finish_reason is not None:
                    done[b] = True
                    n_done += 1
            if n_done == len(rows):
                break
            if n_done and n_done >= self.compact_fraction * len(rows):
                keep = [b for b in range(len(rows)) if not done[b]]
                idx = torch.tensor(keep, device=dev)
                cache = self.cache.compact(cache, idx)
                rows = [rows[b] for b in keep]
                done = [False] * len(rows)
                tokens, next_pos = tokens[idx], next_pos[idx]
                stats["compactions"] += 1
            h = self._decode_hidden(tokens[:, None], position_ids=next_pos[:, None], cache=cache)  # (B, 1, C)
            logits = self.model.lm_head(h[:, -1])  # (B, V)
            if self._moe:
                routing = self._routing(len(rows), 1)  # (B, 1, L, K)
                for b, r in enumerate(rows):
                    if not done[b]:  # a finished row still in the batch was fed a token that is not its own
                        r.routing.append(routing[b])
            next_pos = next_pos + 1
            stats["decode_steps"] += 1
        stats["decode_s"] += _elapsed(t0, dev)

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

    # ------------------------------------------------------------------------------------------
    # stop strings and text

    def _stop_window(self, stop: tuple[str, ...]) -> int:
        """How many trailing tokens to decode to see any stop string that the newest token may have
        completed: a text token decodes to at least one character, plus slack for tokens that only
        complete a multi-byte character."""
        return max((len(s) for s in stop), default=0) + 2 if stop else 0

    def _hits_stop(self, tokens: list[int], stop: tuple[str, ...], window: int) -> bool:
        """Stop strings are matched in the text as `text` reports it (special tokens skipped); only
        the tail is decoded, so the check costs the same at every step."""
        tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        return any(s in tail for s in stop)

    def _final_text(self, r: _Request, stop: tuple[str, ...]) -> str:
        text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        if r.finish_reason == "stop":
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
            text = text[:cut]
        return text


def _elapsed(t0: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
