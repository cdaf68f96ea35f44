"""The rollout side of a local run: jetflow's native engine over its own copy of the model.

It receives weights only through `load_weights` (jetflow.sync), exactly as a remote engine would:
under `unified` the trainer's FP8 bytes, under `mixed` bf16 weights that it quantizes itself.
"""

from __future__ import annotations

from dataclasses import replace

from jetflow.config import Config
from jetflow.model import Decoder, ModelConfig
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.conversation import ConversationDriver
from jetflow.rollout.engine import RolloutOutput, default_kv_pool_bytes
from jetflow.rollout.types import Rollouts
from jetflow.sync import WeightUpdate, apply_update


def kv_pool_bytes(cfg: Config, arch: ModelConfig, max_seq_len: int) -> int:
    """The native engine's page pool budget in a run: rollout.kv_cache_gib, or the engine's default of
    rollout.max_batch requests of max_seq_len positions at fp32 (default_kv_pool_bytes)."""
    r = cfg.rollout
    if r.kv_cache_gib is not None:
        return int(r.kv_cache_gib * 2**30)
    return default_kv_pool_bytes(arch, r.max_batch, max_seq_len)


class NativeRollout:
    def __init__(self, model: Decoder, cfg: Config, tokenizer, eos_token_ids: list[int], stop: tuple[str, ...],
                 max_seq_len: int, fingerprint: str | None, driver: ConversationDriver | None = None):
        """`driver`: a multi-turn run's conversations (jetflow.rollout.conversation); None: one turn a prompt."""
        self.model, self.fingerprint, self.driver = model, fingerprint, driver
        self.max_total_tokens = max_seq_len
        self.eos = frozenset(eos_token_ids)
        self.engine = RolloutEngine(model, eos_token_ids=eos_token_ids, pad_token_id=tokenizer.pad_token_id,
                                    max_batch=cfg.rollout.max_batch, max_seq_len=max_seq_len,
                                    device=cfg.model.device, tokenizer=tokenizer,
                                    kv_cache_bytes=kv_pool_bytes(cfg, model.config, max_seq_len),
                                    record_routing=cfg.algo.routing_replay)
        r = cfg.rollout
        single_token_stops = {s for s in stop if len(tokenizer.encode(s)) == 1}
        turn_stops = driver.stop if driver is not None else ()  # a tool call's close ends a turn
        self.params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                     top_k=r.top_k, stop=tuple(s for s in (*stop, *r.stop, *turn_stops)
                                                               if s not in single_token_stops))
        self.weight_version = -1
        self.reprefill = cfg.rollout.inflight_updates == "reprefill"  # at an in-flight update (else keep_kv)
        self._started: Rollouts | None = None  # a batch `start` finished before its pause

    def load_weights(self, update: WeightUpdate) -> None:
        self.weight_version = apply_update(self.model, update, self.weight_version, self.fingerprint)
        self.engine.weight_version = self.weight_version

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False,
                 problems: list | None = None) -> Rollouts:
        params = replace(self.params, temperature=0.0) if greedy else self.params
        if self.driver is None or problems is None:
            return _one_turn(self.engine.generate(prompts, params, seeds=seeds))
        self.driver.start(problems)  # conversations: the engine keeps each one's pages between its turns
        out = self.engine.generate(prompts, params, seeds=seeds, on_turn_end=self.driver.after_turn,
                                   max_total_tokens=self.max_total_tokens)
        return self.driver.rollouts(prompts, out.token_ids, out.logprobs, out.token_masks, out.texts, out.finish_reasons,
                                    out.weight_version, self.eos)

    def start(self, prompts: list[list[int]], seeds: list[int], pause_at: int) -> None:
        """A batch to be finished by `finish` after the next weight update (in-flight updates, jetflow.run.inflight):
        generated up to `pause_at` decode steps under the current weights."""
        out = self.engine.start(prompts, self.params, seeds, pause_at)
        self._started = None if out is None else _one_turn(out)

    def finish(self) -> Rollouts:
        """The batch `start` began, finished under the weights loaded since (rollout.inflight_updates: its running
        requests re-prefilled, or their K/V pages kept)."""
        out, self._started = self._started, None
        return out if out is not None else _one_turn(self.engine.resume(self.reprefill))


def _one_turn(out: RolloutOutput) -> Rollouts:
    return Rollouts(token_ids=out.token_ids, logprobs=out.logprobs, texts=out.texts, finish_reasons=out.finish_reasons,
                    weight_version=out.weight_version, routed_experts=out.routed_experts,
                    token_versions=out.token_versions)
