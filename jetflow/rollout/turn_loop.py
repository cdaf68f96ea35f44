"""Multi-turn rollouts on an engine that generates whole turns from token ids (vLLM): the conversation loop,
turn by turn.

The native engine runs conversations inside its own scheduler (jetflow.rollout.engine: a conversation keeps
its pages and resumes as soon as its observation comes). An engine that only takes token-id prompts (vLLM,
jetflow.rollout.vllm.adapter) gets the same conversations from this loop: every live conversation's whole
context (prompt, model turns and observations, as ids: token in, token out, never re-tokenized) is one
request of a turn's batch; the driver (jetflow.rollout.conversation) makes each observation's ids; the next
turn starts when the batch's observations have come. The context's prefill is recomputed each turn unless the
engine's prefix cache holds it (vLLM's, where the execution allows it).

The rules are the native engine's: a turn that ends on EOS or a stop string is handed to the driver; one that
reaches its token limit ends the conversation ("length"); an observation that leaves no room for one more
token within `max_total_tokens` ends it "length" too, trained on what it has; observation tokens get mask 0
and log-prob 0.0.
"""

from __future__ import annotations

from typing import Callable

from jetflow.rollout.conversation import ConversationDriver
from jetflow.rollout.parked import observation_fits

# contexts (token ids), seeds and each request's token limit -> (tokens, log-probs, finish reasons) per request
TurnGenerate = Callable[[list[list[int]], list[int], list[int]], tuple[list[list[int]], list[list[float]], list[str]]]


def turn_seed(seed: int, turn: int) -> int:
    """A request's sampling seed at a turn: its own seed at the first turn (one turn is unchanged), then
    another stream per turn (an engine's per-request seed restarts its generator with each request)."""
    return seed if turn == 0 else (seed * 1_000_003 + turn) % (2**63 - 1)


def generate_by_turns(generate_turn: TurnGenerate, driver: ConversationDriver, prompts: list[list[int]],
                      seeds: list[int], max_new_tokens: int, max_total_tokens: int
                      ) -> tuple[list[list[int]], list[list[float]], list[list[int]], list[str]]:
    """The conversations of `prompts` (the driver started on their problems): per conversation the tokens
    after its prompt (the model's and the observations'), their log-probs (0.0 at observations), the mask
    (1 on a token the model sampled) and the finish reason."""
    for i, p in enumerate(prompts):
        if len(p) >= max_total_tokens:
            raise ValueError(f"request {i}: its {len(p)}-token prompt leaves no room in max_total_tokens={max_total_tokens}")
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    masks: list[list[int]] = [[] for _ in range(n)]
    reasons = [""] * n
    live, turn = list(range(n)), 0
    while live:
        contexts = [prompts[i] + tokens[i] for i in live]
        limits = [min(max_new_tokens, max_total_tokens - len(c)) for c in contexts]
        new, lps, why = generate_turn(contexts, [turn_seed(seeds[i], turn) for i in live], limits)
        handed = {}
        for j, i in enumerate(live):
            tokens[i] += new[j]
            logprobs[i] += lps[j]
            masks[i] += [1] * len(new[j])
            reasons[i] = why[j]
            if why[j] in ("eos", "stop") and (future := driver.after_turn(i, new[j], why[j])) is not None:
                handed[i] = future
        live = []
        for i, future in handed.items():
            ids = future.result()  # an environment's error ends the generate here
            if ids is not None and not observation_fits(len(prompts[i]) + len(tokens[i]), len(ids), max_total_tokens):
                reasons[i], ids = "length", None
            if ids is None:
                continue
            tokens[i] += ids
            logprobs[i] += [0.0] * len(ids)
            masks[i] += [0] * len(ids)
            live.append(i)
        turn += 1
    return tokens, logprobs, masks, reasons
