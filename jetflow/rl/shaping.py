"""DAPO's reward shaping and batch filtering (Yu et al. 2025, arXiv 2503.14476), on per-sample rewards:

    overlong_penalty     the soft overlong punishment: a response longer than max_new_tokens - buffer
                         loses up to `factor` reward, linearly over the last `buffer` tokens
    informative_groups   dynamic sampling's filter: a group whose rewards are all equal has zero
                         advantage for every sample (it teaches nothing) and is dropped
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, factor: float) -> Tensor:
    """Per-response reward penalty (N,), <= 0: min(0, -(length - (max_new_tokens - buffer)) / buffer * factor),
    as verl's DAPO reward manager (`overlong_buffer`). `lengths` (N,): generated tokens of each response."""
    if buffer < 1 or buffer > max_new_tokens:
        raise ValueError(f"overlong buffer {buffer} must be in [1, max_new_tokens={max_new_tokens}]")
    expected = max_new_tokens - buffer
    exceed = lengths.float() - expected  # (N,)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(P,) bool: True for the groups whose rewards are not all equal. `rewards` (P * group_size,),
    group g at [g * G, (g + 1) * G)."""
    groups = rewards.view(-1, group_size)  # (P, G)
    return (groups != groups[:, :1]).any(dim=1)  # (P,)
