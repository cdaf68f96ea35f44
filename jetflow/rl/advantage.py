"""GRPO group-relative advantages.

Each prompt is sampled ``group_size`` times; the advantage of a sample is its reward relative to
the other samples of the same prompt, so no value network is needed (GRPO, Shao et al. 2024).
"""

from __future__ import annotations

from torch import Tensor

NORMS = ("mean_std", "mean", "none")


def group_advantages(
    rewards: Tensor, group_size: int, norm: str = "mean_std", eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages from per-sample rewards, normalised within each group.

    Args:
        rewards: (N,) with N = num_prompts * group_size; samples ``[g*G, (g+1)*G)`` share a prompt.
        group_size: G, samples per prompt.
        norm: ``"mean_std"``: (r - mean) / (std + eps), the GRPO default.
              ``"mean"``: r - mean, no std division (Dr. GRPO: the std division up-weights
              prompts that are nearly always right or always wrong).
              ``"none"``: the raw rewards.
        eps: added to the std so that a group of identical rewards gives 0, not NaN.

    The std is the *population* std (``unbiased=False``, divide by G), so G = 1 is well defined
    (advantage 0). verl and TRL use the Bessel-corrected std (divide by G - 1); their advantages are
    ours times sqrt((G - 1) / G).

    Returns:
        (N,) float advantages, same order as ``rewards``.
    """
    if norm not in NORMS:
        raise ValueError(f"unknown advantage norm {norm!r}; valid: {', '.join(NORMS)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) must be a positive multiple of "
            f"group_size ({group_size})"
        )
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    if norm == "none":
        return rewards.clone()

    groups = rewards.view(-1, group_size)  # (P, G)
    adv = groups - groups.mean(dim=1, keepdim=True)  # (P, G)
    if norm == "mean_std":
        adv = adv / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1)  # (N,)
