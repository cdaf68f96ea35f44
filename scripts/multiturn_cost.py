"""What page reuse between turns saves, and what a slow tool costs the other conversations (issue 69).

SmolLM2-135M (fp32, exact numerics), N conversations of T turns: each turn ends at a sentence's end (".")
or EOS, and the observation, a user message "Go on." rendered by the chat template (token in, token out),
comes back at once. Two ways to continue a conversation, the same tokens under exact numerics:
  reuse      the engine keeps the conversation's KV pages; a turn prefills only its observation
  reprefill  each turn prefills the whole conversation again (what an engine without page reuse does)
Printed per arm: tokens prefilled per conversation, wall seconds, sampled tokens per second.

Then the slow tool: one conversation's observations arrive 2 s late; the others' sampled tokens per second
(their tokens over the time until the last of them ends) against the same others run without that conversation
(others_alone: the same seeds; with it in the batch and fast, the others share the steps with one more row).

    python scripts/multiturn_cost.py --turns 4 16 --conversations 4 > results/multiturn/cost.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import threading
import time

import torch

from jetflow.config import load_config
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.turns import TurnRenderer
from jetflow.run.build import build_policy


def run(engine, renderer, prompts, turns: int, reprefill: bool, slow: int | None = None,
        seeds: list[int] | None = None) -> dict:
    done: dict[int, float] = {}
    counts = [0] * len(prompts)
    obs = renderer.observation_messages("env", ["Go on."])

    def on_turn_end(i, ids, reason):
        counts[i] += 1
        if counts[i] >= turns:
            done[i] = time.perf_counter()
            return None
        f: concurrent.futures.Future = concurrent.futures.Future()
        result = renderer.observation_ids(obs, reason == "eos")
        if i == slow:
            threading.Timer(2.0, lambda: f.set_result(result)).start()
        else:
            f.set_result(result)
        return f

    params = SamplingParams(max_new_tokens=64, temperature=1.0, stop=(".",))
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seeds=seeds or list(range(len(prompts))), on_turn_end=on_turn_end,
                          max_total_tokens=engine.max_seq_len, reprefill_turns=reprefill)
    wall = time.perf_counter() - t0
    sampled = [sum(m) for m in out.token_masks]
    others = [i for i in range(len(prompts)) if i != slow and i in done]
    end = max(done[i] for i in others) - t0 if others else wall
    return {"turns": turns, "arm": "reprefill" if reprefill else "reuse", "slow_tool": slow is not None,
            "prefill_tokens_per_conversation": engine.last_stats["prefill_tokens"] / len(prompts),
            "wall_s": round(wall, 2), "sampled_tokens": sum(sampled),
            "sampled_tokens_per_s": round(sum(sampled) / wall, 1),
            "others_tokens_per_s": round(sum(sampled[i] for i in others) / end, 1),
            "turns_done_mean": sum(counts) / len(counts), "tokens": out.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--conversations", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(None, ["model.path=smollm2", "precision.mode=bf16", "precision.numerics=exact"])
    model, tok = build_policy(cfg)
    from jetflow.precision import apply_precision
    apply_precision(model, "fp32", numerics="exact")
    model.numerics = "exact"
    renderer = TurnRenderer(tok, True)
    topics = ["cats", "rivers", "trains", "bread", "winter", "music", "bees", "the moon"]
    prompts = [renderer.prompt_ids(f"Write short sentences about {t}.") for t in topics[:args.conversations]]
    engine = RolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch=args.conversations,
                           max_seq_len=2048, tokenizer=tok)
    run(engine, renderer, prompts[:1], 2, False)  # warm-up: the first calls pay for allocation
    rows = []
    for turns in args.turns:
        reuse, again = run(engine, renderer, prompts, turns, False), run(engine, renderer, prompts, turns, True)
        assert reuse["tokens"] == again["tokens"], "page reuse changed the tokens"
        rows += [reuse, again]
        if turns == min(args.turns):  # the slow tool, and the same others without the slow conversation
            rows.append(run(engine, renderer, prompts, turns, False, slow=0))
            alone = run(engine, renderer, prompts[1:], turns, False, seeds=list(range(1, len(prompts))))
            rows.append({**alone, "arm": "others_alone"})
    for r in rows:
        r.pop("tokens")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
