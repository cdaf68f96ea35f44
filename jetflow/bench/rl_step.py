"""`jetflow bench rl-step`: seconds per GRPO step, jetflow's loop vs TRL's `GRPOTrainer`, same work.

One step = rollout of `prompts` x `group_size` samples (at most `max_new_tokens` each, stopping at
EOS, temperature 1) + rewards + group advantages + policy-gradient update (AdamW). jetflow's step is
`RLLoop.step` as `jetflow train` runs it (weight sync, rollout on the native engine, the update,
whose own forward gives the old log-probs and mismatch metrics); TRL's is one `GRPOTrainer` optimizer
step (see jetflow.bench.trl_grpo for its settings). With one optimizer step per generation neither
side runs a separate old-log-prob forward. Both sides get the same chat-templated prompt
strings (the token ids are checked equal), the same reward (jetflow's task verifier), the same
learning rate and clipping, in fp32 on the same model. jetflow also runs `unified` (FP8; emulated on
the CPU).

Each side takes one warm-up step, then `reps` measured steps; the steps are interleaved (TRL step k,
then jetflow's step k in each mode) so that load from other processes hits every side alike. Seconds
per step are medians; the headline is jetflow fp32 / TRL.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from jetflow.bench.common import markdown_table, write_results
from jetflow.bench.workload import LoadAverage, bench_config
from jetflow.config import Config, derive
from jetflow.run.build import load_inputs, prompt_encoder, prompt_text, smollm2_dir
from jetflow.run.loop import RLLoop, rl_seed
from jetflow.run.sides import TrainerSide
from jetflow.tasks import Task

JETFLOW_MODES = ("fp32", "unified")


def build_loop(cfg: Config) -> tuple[RLLoop, Task, object]:
    """The RL loop of `jetflow train` (jetflow.run.local) without a run directory."""
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    return side.rl_loop(), side.task, side.tokenizer


def hf_model_dir(cfg: Config) -> Path | None:
    """The Hugging Face directory TRL can load, or None (model.path=tiny has none)."""
    if cfg.model.path == "tiny":
        return None
    return smollm2_dir(cfg.model.cache_dir) if cfg.model.path == "smollm2" else Path(cfg.model.path)


def check_same_prompt_ids(model_dir: Path, texts: list[str], jetflow_ids: list[list[int]]) -> bool:
    """TRL tokenizes prompt strings with the HF tokenizer's __call__: same ids as jetflow's?"""
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    return hf(text=texts)["input_ids"] == jetflow_ids


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def run(model: str = "smollm2", prompts: int = 4, group_size: int = 4, max_new_tokens: int = 32, reps: int = 2,
        modes: tuple[str, ...] = JETFLOW_MODES, compare_trl: bool = True, out_dir: str = "results/bench",
        name: str | None = None) -> dict:
    """Benchmark and write <out_dir>/rl-step-cpu.{json,md} (or `name`); returns the payload."""
    steps = 1 + reps
    overrides = [f"train.prompts_per_step={prompts}", f"rollout.group_size={group_size}",
                 f"rollout.max_new_tokens={max_new_tokens}", f"train.steps={steps}"]
    cfgs = {mode: bench_config(model, [*overrides, f"precision.mode={mode}"]) for mode in modes}
    cfg = next(iter(cfgs.values()))
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    loops, task, tokenizer = {}, None, None
    for mode, mode_cfg in cfgs.items():
        loops[mode], task, tokenizer = build_loop(mode_cfg)
    problems = task.problems(0, steps * prompts, rl_seed(cfg.run))  # what RLLoop.step(k) draws, k = 0 .. steps-1
    texts = [prompt_text(cfg, tokenizer, task, p) for p in problems]
    encode = prompt_encoder(cfg, tokenizer, task)
    jetflow_ids = [encode(p) for p in problems]
    if any(tokenizer.encode(t) != ids for t, ids in zip(texts, jetflow_ids)):
        raise RuntimeError("rl-step: prompt strings do not re-encode to jetflow's prompt ids")

    records: dict[str, list[dict]] = {f"jetflow {mode}": [] for mode in loops}

    def jetflow_step(k: int) -> None:
        for mode, loop in loops.items():
            t0, cpu0 = time.perf_counter(), time.process_time()
            m = loop.step(k)
            dt = time.perf_counter() - t0
            records[f"jetflow {mode}"].append({
                "seconds": dt, "cpu_seconds": time.process_time() - cpu0, "rollout_s": m["time/rollout"],
                "old_logprobs_s": m["time/old_logprobs"], "train_s": m["time/train"], "sync_s": m["time/sync"],
                "reward_mean": m["reward/mean"],
                "response_len_mean": m["response/length_mean"], "torch_threads": torch.get_num_threads()})
            print(f"  step {k}: jetflow {mode:8s} {dt:7.2f} s  (rollout {m['time/rollout']:.2f}, old logprobs "
                  f"{m['time/old_logprobs']:.2f}, train {m['time/train']:.2f}, sync {m['time/sync']:.2f}; "
                  f"mean response {m['response/length_mean']:.1f} tokens)", flush=True)

    notes: list[str] = []
    trl_settings = None
    model_dir = hf_model_dir(cfg)
    with LoadAverage() as load:
        trl_records = None
        if not compare_trl:
            notes.append("TRL not run (compare_trl=False)")
        elif model_dir is None:
            notes.append(f"TRL skipped: it needs a Hugging Face model directory; model={model!r} has none")
        else:
            from jetflow.bench import trl_grpo
            try:
                trl_grpo.import_trl()
            except ImportError as e:
                notes.append(f"TRL skipped: {e}")
            else:
                same_ids = check_same_prompt_ids(model_dir, texts, jetflow_ids)
                if not same_ids:
                    raise RuntimeError("rl-step: TRL's tokenization of the prompt strings differs from jetflow's")
                trl_settings = {**trl_grpo.grpo_settings(group_size, prompts, max_new_tokens),
                                "prompt_ids_identical": same_ids}
                chunks = [texts[k * prompts:(k + 1) * prompts] for k in range(steps)]

                def score(i: int, completion: str) -> float:
                    return task.score(problems[i], completion).total

                def between(k: int, record: dict) -> None:
                    print(f"  step {k}: trl GRPOTrainer  {record['seconds']:7.2f} s  (rollout "
                          f"{record.get('rollout_s', float('nan')):.2f}; mean response "
                          f"{record.get('response_len_mean', float('nan')):.1f} tokens)", flush=True)
                    jetflow_step(k)

                trl_records = trl_grpo.run_grpo_steps(
                    str(model_dir), chunks, score, group_size, max_new_tokens, lr=cfg.train.lr,
                    clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high, temperature=cfg.rollout.temperature,
                    seed=cfg.run.seed, between_steps=between)
                records["trl GRPOTrainer fp32"] = trl_records
        if trl_records is None:
            for k in range(steps):
                jetflow_step(k)

    rows = []
    for system, recs in records.items():
        measured = recs[1:] or recs
        row = {"system": system, "seconds_per_step": _median(measured, "seconds"),
               "cpu_seconds_per_step": _median(measured, "cpu_seconds"), "warmup_s": recs[0]["seconds"],
               "seconds_all": [round(r["seconds"], 2) for r in recs],
               "response_len_mean": _median(measured, "response_len_mean"),
               "reward_mean": _median(measured, "reward_mean")}
        for key in ("rollout_s", "old_logprobs_s", "train_s", "sync_s"):
            if recs[0].get(key) is not None:
                row[key] = _median(measured, key)
        rows.append(row)
    trl_row = next((r for r in rows if r["system"].startswith("trl")), None)
    ratios = {}
    if trl_row is not None:
        trl_steps = records["trl GRPOTrainer fp32"]
        for r in rows:
            r["vs_trl"] = r["seconds_per_step"] / trl_row["seconds_per_step"]
            r["cpu_vs_trl"] = r["cpu_seconds_per_step"] / trl_row["cpu_seconds_per_step"]
            if r is not trl_row:
                key = r["system"].replace(" ", "_")
                ratios[f"{key}_over_trl"] = r["vs_trl"]
                ratios[f"{key}_over_trl_cpu"] = r["cpu_vs_trl"]
                # each jetflow step ran right after the TRL step of the same index: the pairs shared the load
                ratios[f"{key}_over_trl_paired_median"] = statistics.median(
                    j["seconds"] / t["seconds"] for j, t in zip(records[r["system"]][1:], trl_steps[1:]))
    for r in rows:
        print(f"  {r['system']:22s} {r['seconds_per_step']:7.2f} s/step  {r['cpu_seconds_per_step']:7.2f} CPU s/step"
              + (f"  {r['vs_trl']:.2f}x TRL (CPU time {r['cpu_vs_trl']:.2f}x)" if "vs_trl" in r else ""))
    for note in notes:
        print(f"  note: {note}")

    headline = {"name": "jetflow fp32 / TRL GRPOTrainer fp32 seconds per GRPO step (target <= 0.5)",
                "value": ratios.get("jetflow_fp32_over_trl")}
    payload = {"workload": {"model": model, "prompts": prompts, "group_size": group_size,
                            "max_new_tokens": max_new_tokens, "reps": reps, "warmup_steps": 1,
                            "temperature": cfg.rollout.temperature, "lr": cfg.train.lr, "task": cfg.task.name,
                            "prompt_strings": texts},
               "trl_settings": trl_settings, "rows": rows, "ratios": ratios, "headline": headline, "notes": notes,
               "steps": records, "loadavg_1m": load.record()}
    md = (f"Seconds per GRPO step on model `{model}`: {prompts} prompts x {group_size} samples, at most "
          f"{max_new_tokens} new tokens (EOS stops), temperature {cfg.rollout.temperature}, task `{cfg.task.name}`, "
          f"same prompt strings and reward on every side. Median of {reps} steps after one warm-up step, the sides "
          f"interleaved step by step. jetflow: `RLLoop.step` (sync + rollout + update; with ppo_epochs=1 the "
          f"update's own forward gives the old log-probs, algo.old_logprobs=auto); TRL: one "
          f"`GRPOTrainer` optimizer step, fp32 on the CPU, no vLLM, no gradient checkpointing. {load.sentence()}\n\n"
          + markdown_table(rows, ["system", "seconds_per_step", "vs_trl", "cpu_seconds_per_step", "cpu_vs_trl",
                                  "warmup_s", "rollout_s", "old_logprobs_s", "train_s", "sync_s", "response_len_mean",
                                  "reward_mean"])
          + "\n\nseconds = wall clock; cpu_seconds = this process's CPU time (all its threads), less sensitive to "
            "other processes on a shared machine; `_paired_median` = median over steps of jetflow step k / TRL step k "
            "(run back to back)."
          + ("\n\n" + "\n".join(f"- {k}: {v:.3f}" for k, v in ratios.items()) if ratios else "")
          + ("\n\n" + "\n".join(f"- note: {n}" for n in notes) if notes else ""))
    tag = "gpu" if torch.device(cfg.model.device).type == "cuda" else "cpu"
    path = write_results(name or f"rl-step-{tag}", payload, md, out_dir)
    print(f"wrote {path}")
    return payload
