"""The rollout side of a local run: jetflow's native engine over its own copy of the model.

It receives weights only through `load_weights` (jetflow.sync), exactly as a remote engine would:
under `unified` the trainer's FP8 bytes, under `mixed` bf16 weights that it quantizes itself.
"""

from __future__ import annotations

from dataclasses import replace

from jetflow.config import Config
from jetflow.model import Decoder
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.types import Rollouts
from jetflow.sync import WeightUpdate, apply_update


class NativeRollout:
    def __init__(self, model: Decoder, cfg: Config, tokenizer, eos_token_ids: list[int], stop: tuple[str, ...],
                 max_seq_len: int, fingerprint: str | None):
        self.model, self.fingerprint = model, fingerprint
        self.engine = RolloutEngine(model, eos_token_ids=eos_token_ids, pad_token_id=tokenizer.pad_token_id,
                                    max_batch=cfg.rollout.max_batch, max_seq_len=max_seq_len,
                                    device=cfg.model.device, tokenizer=tokenizer,
                                    kv_cache_bytes=(None if cfg.rollout.kv_cache_gib is None
                                                    else int(cfg.rollout.kv_cache_gib * 2**30)),
                                    record_routing=cfg.algo.routing_replay)
        r = cfg.rollout
        single_token_stops = {s for s in stop if len(tokenizer.encode(s)) == 1}
        self.params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                     top_k=r.top_k, stop=tuple(s for s in (*stop, *r.stop) if s not in single_token_stops))
        self.weight_version = -1

    def load_weights(self, update: WeightUpdate) -> None:
        self.weight_version = apply_update(self.model, update, self.weight_version, self.fingerprint)
        self.engine.weight_version = self.weight_version

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False) -> Rollouts:
        params = replace(self.params, temperature=0.0) if greedy else self.params
        out = self.engine.generate(prompts, params, seeds=seeds)
        return Rollouts(token_ids=out.token_ids, logprobs=out.logprobs, texts=out.text,
                        finish_reasons=out.finish_reason, weight_version=out.weight_version,
                        routed_experts=out.routed_experts)
