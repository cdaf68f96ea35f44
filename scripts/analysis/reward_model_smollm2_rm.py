"""A SmolLM2-sized reward model for the one-step time measurement (issue 74): SmolLM2-135M-Instruct's
decoder with a fresh one-label score head (seeded), saved as a Hugging Face directory with its tokenizer.

    python scripts/analysis/reward_model_smollm2_rm.py runs/reward_model/smollm2-rm

The head is untrained: the run measures what a reward model of this size costs a step (memory and
time), not a preference.
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from jetflow.config import load_config
from jetflow.run.build import smollm2_dir


def main(out: Path) -> None:
    source = smollm2_dir(load_config(None, []).model.cache_dir)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
