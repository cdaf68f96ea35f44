"""results/lora: the weight-sync payload (`sync/bytes`, jetflow.sync.build_update) of a model shape under unified,
full fine-tuning against LoRA (the first update: base + adapters; each later one: the adapters alone), on a
randomly initialised Decoder of that shape (the payload depends on the shapes, not the values).

    python scripts/analysis/lora_sync_payload.py [1b|smollm2] [rank]

1b: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 / 8 heads, intermediate 8192, vocabulary 128,256, tied).
"""

from __future__ import annotations

import sys

import torch

from jetflow.config import derive, load_config
from jetflow.model import Decoder, ModelConfig
from jetflow.precision.lora import adapter_parameters
from jetflow.run.build import apply_mode, with_lora
from jetflow.sync import build_update

SHAPES = {
    "1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "smollm2": ModelConfig(vocab_size=49152, tie_word_embeddings=True),
}


def payloads(shape: str, rank: int) -> dict[str, int]:
    cfg = load_config(None, ["precision.mode=unified", f"model.lora.rank={rank}"])
    precision = derive(cfg).precision
    torch.manual_seed(0)
    with torch.no_grad():
        model = apply_mode(Decoder(SHAPES[shape]), precision, "trainer")
        full = build_update(model, "unified", 0, precision.fingerprint).nbytes()
        model = with_lora(model, cfg, "trainer")  # in place: the adapters, the base frozen to its FP8 bytes
        first = build_update(model, "unified", 0, precision.fingerprint).nbytes()
        later = build_update(model, "unified", 1, precision.fingerprint, base=False).nbytes()
    params = sum(p.numel() for p in adapter_parameters(model).values())
    return {"full": full, "lora_first": first, "lora_later": later, "adapter_params": params}


if __name__ == "__main__":
    shape, rank = (sys.argv[1] if len(sys.argv) > 1 else "1b"), int(sys.argv[2]) if len(sys.argv) > 2 else 16
    p = payloads(shape, rank)
    print(f"{shape}, unified, LoRA rank {rank} ({p['adapter_params']:,} adapter parameters): full update "
          f"{p['full']:,} B; LoRA first {p['lora_first']:,} B; each later {p['lora_later']:,} B "
          f"({p['lora_later'] / p['full']:.4f} of full)")
