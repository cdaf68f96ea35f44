"""jetflow: numerically on-policy FP8 RL post-training (see README.md and ARCHITECTURE.md)."""

import os as _os

# Large CPU tensors on transparent huge pages: torch's CPU allocator reads this once, at its first
# allocation, so it is set before torch is imported (`jetflow ...` commands, and any program that imports
# jetflow first; scripts/train.sh and scripts/test.sh export it too). On a kernel whose THP mode is
# `madvise`, a fresh 100-250 MB tensor (a training step's logits, the lm_head weight's bf16 copies) costs
# ~4x its arithmetic in 4 KB page faults without it (measured: rounding 60M floats 64 ms -> 15 ms, and
# 1.1-1.3 s of a 7.5 s GRPO step on SmolLM2). Values only: placement, never numerics. Set
# THP_MEM_ALLOC_ENABLE=0 to turn it off.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
