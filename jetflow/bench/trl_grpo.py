"""TRL's `GRPOTrainer` as the reference for `jetflow bench rl-step`: the only module that imports TRL.

TRL runs in its plain mode: transformers `generate` for the rollouts (no vLLM), fp32 on the CPU
(`use_cpu=True`, no bf16), no gradient checkpointing, no logging, no reference model (beta = 0),
one optimizer step per generation batch (`per_device_train_batch_size` = prompts x group,
`gradient_accumulation_steps` = 1), the dataset in order (step k sees the k-th block of prompts,
as jetflow's loop does), and jetflow's clipping (epsilon / epsilon_high) and learning rate.

A step is timed (wall clock and this process's CPU time) from the trainer's `on_step_begin` to its
`on_step_end` callback: generation, reward, loss, backward and the optimizer step; its rollout part
(`model.generate`) is timed on its own too. `between_steps(k, record)` runs after step k's timing
ends (the bench runs jetflow's step k there, so both sides see the same machine load).
"""

from __future__ import annotations

import tempfile
import time
from typing import Callable

import torch

from jetflow.errors import MissingDependencyError

INSTALL_HINT = "pip install -e .[bench]"


def import_trl():
    """(trl, datasets) or an ImportError that says what to install."""
    try:
        import datasets
        import trl
    except ImportError as e:
        raise MissingDependencyError(f"the TRL baseline needs `trl` and `datasets` ({e}); install them with "
                          f"`{INSTALL_HINT}`") from e
    return trl, datasets


def trl_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("trl")
    except Exception:
        return None


def run_grpo_steps(model_dir: str, prompts_per_step: list[list[str]], score: Callable[[int, str], float],
                   group_size: int, max_new_tokens: int, lr: float, clip_low: float, clip_high: float,
                   temperature: float = 1.0, seed: int = 0,
                   between_steps: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Run len(prompts_per_step) GRPO steps of TRL; returns one record per step.

    prompts_per_step[k]: the prompt strings of step k (already chat-templated: TRL tokenizes them
    as they are). score(prompt_index, completion) -> reward, prompt_index counting over all steps.
    """
    trl, datasets = import_trl()
    import transformers

    n = len(prompts_per_step[0])
    if any(len(p) != n for p in prompts_per_step):
        raise ValueError("run_grpo_steps: every step needs the same number of prompts")
    rows = [{"prompt": text, "prompt_index": i}
            for i, text in enumerate(t for step in prompts_per_step for t in step)]
    records: list[dict] = [{} for _ in prompts_per_step]
    step_of_call = {"k": 0}

    def arithmetic_score(prompts, completions, prompt_index, completion_ids=None, **kwargs):
        rewards = [score(i, c) for i, c in zip(prompt_index, completions)]
        rec = records[min(step_of_call["k"], len(records) - 1)]
        rec["reward_mean"] = sum(rewards) / len(rewards)
        if completion_ids is not None:
            rec["response_len_mean"] = sum(len(c) for c in completion_ids) / len(completion_ids)
        return rewards

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            k = state.global_step - 1
            records[k].update(seconds=time.perf_counter() - self.t0, cpu_seconds=time.process_time() - self.cpu0,
                              torch_threads=torch.get_num_threads())
            step_of_call["k"] = k + 1
            if between_steps is not None:
                between_steps(k, records[k])

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generate = model.generate

    def timed_generate(*args, **kwargs):  # TRL's rollout: transformers generate on this model
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        rec = records[min(step_of_call["k"], len(records) - 1)]
        rec["rollout_s"] = rec.get("rollout_s", 0.0) + time.perf_counter() - t0
        return out

    model.generate = timed_generate
    with tempfile.TemporaryDirectory(prefix="jetflow-trl-") as out_dir:
        args = trl.GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=n * group_size, gradient_accumulation_steps=1, num_generations=group_size,
            num_iterations=1, max_completion_length=max_new_tokens, max_steps=len(prompts_per_step),
            shuffle_dataset=False, temperature=temperature, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo",
            epsilon=clip_low, epsilon_high=clip_high, learning_rate=lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, report_to="none", logging_strategy="no",
            save_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0, seed=seed)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=arithmetic_score, args=args,
                                  train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                                  callbacks=[StepTimer()])
        trainer.train()
    return records


def grpo_settings(group_size: int, n_prompts: int, max_new_tokens: int) -> dict:
    """The TRL settings the bench uses, for the result file."""
    return {"trl": trl_version(), "use_cpu": True, "dtype": "float32", "use_vllm": False,
            "gradient_checkpointing": False, "per_device_train_batch_size": n_prompts * group_size,
            "gradient_accumulation_steps": 1, "num_generations": group_size, "max_completion_length": max_new_tokens,
            "beta": 0.0, "loss_type": "dapo", "num_iterations": 1}
