"""KV bytes per token of jetflow's exact vLLM engine, from vLLM's own KV cache spec
(VLLMRollout.kv_cache_stats), beside the native engine's page pool, in fp32 / bf16 / unified + FP8 KV.

    PYTHONPATH=. python scripts/analysis/vllm_paged_kv_bytes.py [tiny|smollm2]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from jetflow.config import derive, load_config
from jetflow.model.paged_cache import PagePool
from jetflow.rollout.vllm import VLLMRollout
from jetflow.run.build import apply_mode, attach_kv_fp8, build_policy, copy_model
from jetflow.run.vllm_side import write_engine_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CASES = [("fp32", False), ("bf16", False), ("unified", True)]


def main(which: str) -> None:
    config = str(ROOT / "configs/tiny.yaml") if which == "tiny" else None
    print("| model | mode | vLLM kv_cache_dtype | block | vLLM bytes/token | native page dtype | native bytes/token |")
    print("|---|---|---|---|---|---|---|")
    for mode, kv8 in CASES:
        cfg = load_config(config, [f"precision.mode={mode}", f"precision.kv_cache_fp8={str(kv8).lower()}",
                                   "precision.numerics=exact", "rollout.backend=vllm"])
        model, tok = build_policy(cfg)
        policy = apply_mode(copy_model(model), derive(cfg).precision, "rollout")
        quantizer = attach_kv_fp8(policy, derive(cfg).precision, "rollout") or policy.model.layers[0].self_attn.kv_quantizer  # type: ignore[index, union-attr]
        with tempfile.TemporaryDirectory() as tmp:
            path = write_engine_checkpoint(policy, tok, Path(tmp), "exact", None)
            rollout = VLLMRollout(path, execution="exact", policy=policy, recipe=cfg.precision.recipe(),
                                  max_model_len=128, max_batch=4, kv_cache_bytes=256 << 20)
            try:
                s = rollout.kv_cache_stats()
            finally:
                rollout.close()
        c = model.config
        page_dtype = getattr(quantizer, "page_dtype", torch.float32)
        native = PagePool.page_bytes(c.num_layers, c.num_kv_heads, c.head_dim, page_dtype) // 64
        print(f"| {which} | {mode}{' + FP8 KV' if kv8 else ''} | {s['kv_cache_dtype']} | {s['kv_block_size']} | "
              f"{s['kv_bytes_per_token']:,} | {str(page_dtype).replace('torch.', '')} | {native:,} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")
