"""The policies the exact vLLM plugin serves, by token (jetflow.rollout.vllm.plugin registers the plugin).

An exact engine names its policy by a token in its quantization config (`serve`), because vLLM copies
its configs; the token is looked up here, in this process: the exact path needs the in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0, which the adapter sets). The plugin's pieces (quant, attention, ops,
moe) ask `exact_policy(vllm_config)` whether their engine is exact, and which policy computes it.
"""

from __future__ import annotations

import itertools
import re

from jetflow.errors import UserError
from jetflow.model import Decoder

QUANT_METHOD = "jetflow_exact"

_policies: dict[str, Decoder] = {}
_tokens = itertools.count()


class UnservedError(UserError, ValueError):
    """The plugin cannot serve this model or layer (the message names it)."""


def serve(policy: Decoder) -> str:
    """A token naming `policy` for one engine's quantization config (see `release`)."""
    token = f"policy-{next(_tokens)}"
    _policies[token] = policy
    return token


def release(token: str) -> None:
    _policies.pop(token, None)


def policy_for(token: str) -> Decoder:
    try:
        return _policies[token]
    except KeyError:
        raise UnservedError(f"the exact vLLM engine's policy {token!r} is not served in this process: the exact "
                            "path runs vLLM in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)") from None


def exact_policy(vllm_config) -> Decoder | None:
    """The policy of the engine this vLLM config builds, or None for an engine that is not exact."""
    quant = getattr(vllm_config, "quant_config", None)
    return policy_for(quant.token) if quant is not None and quant.get_name() == QUANT_METHOD else None


def layer_index(name: str) -> int:
    """The decoder layer of a vLLM or HF module name (`model.layers.3.self_attn.attn` -> 3)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m is None:
        raise UnservedError(f"exact vLLM plugin: cannot tell the decoder layer of {name!r}")
    return int(m.group(1))
