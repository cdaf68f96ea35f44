"""One timed generate of the native engine from whichever jetflow is on PYTHONPATH (this branch's paged,
continuous engine, or main's dense static one): SmolLM2 fp32 exact, `batch` random 64-token prompts,
exactly `new` tokens each (EOS ignored), temperature 1, after a 2-token warm-up. Prints one JSON line.

    PYTHONPATH=/work/main python scripts/kv_long_engine_ab.py main 16 128
    PYTHONPATH=. python scripts/kv_long_engine_ab.py branch 16 128
"""
import json
import sys
import time

import torch

from jetflow.model import load, load_tokenizer
from jetflow.precision import apply_precision
from jetflow.rollout import RolloutEngine, SamplingParams

label, batch, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path = sys.argv[4] if len(sys.argv) > 4 else ".cache/models/smollm2"
model = load(path, device="cpu").eval()
apply_precision(model, "fp32", numerics="exact")
model.numerics = "exact"
tok = load_tokenizer(path)
engine = RolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, max_batch=batch, max_seq_len=64 + new)
prompts = torch.randint(100, tok.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(batch)).tolist()
seeds = list(range(batch))
engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True), seeds=seeds)
t = time.perf_counter()
out = engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True), seeds=seeds)
dt = time.perf_counter() - t
mem = engine.memory_stats()
print(json.dumps({"engine": label, "batch": batch, "new_tokens": new, "seconds": round(dt, 2),
                  "tokens_per_s": round(batch * new / dt, 1), "prefill_s": round(out.stats["prefill_s"], 2),
                  "decode_ms_per_step": round(1e3 * out.stats["decode_s"] / out.stats["decode_steps"], 1),
                  "kv_cache_mib": round(mem["kv_cache_bytes"] / 2**20, 1), "threads": torch.get_num_threads(),
                  "first_tokens": out.token_ids[0][:8]}))
