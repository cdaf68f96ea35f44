"""Multi-turn, tool-using rollouts (jetflow.rollout.conversation): token in, token out, exactly on-policy.

The exactness cases run the mismatch benchmark's path (trainer and rollout built as in a run, weights through
jetflow.sync, the FP8 KV scales calibrated on a trainer forward) on conversations of up to 4 turns with a tool
between them: every token the model sampled has the trainer's log-prob bit for bit (`torch.equal`), the
observation tokens are masked out, and the engine prefilled only each observation (its pages kept).

A tiny model with random weights never writes a hermes tool call, so those cases use a test-only tool format
(FORMATS patched) whose turn ends at any of twenty characters and whose every turn is a call to `echo`: the
engine, the driver, the tool pool and the renderer are the run's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from jetflow.bench.mismatch import paired_logprobs
from jetflow.config import load_config
from jetflow.rollout import tool_format as tf
from jetflow.run.build import build_policy, build_task, prompt_encoder

ROOT = Path(__file__).resolve().parents[2]
TOOLS = '''
import time


def echo(text: str) -> str:
    """Say the text back.

    Args:
        text: What to say back.
    """
    return "[" + text + "]"


def said(prompts, completions, answer, **kwargs):
    """1 when the last message holds the row's word."""
    last = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a in t) for t, a in zip(last, answer)]


def slow(text: str) -> str:
    """Sleep, then say the text back.

    Args:
        text: What to say back.
    """
    time.sleep(2)
    return text
'''
EVERY_TURN = tf.ToolFormat("every_turn", tuple("aeiouAEIOU0123456789"), lambda text: [tf.ToolCall("echo", {"text": text[-5:]})],
                           lambda schemas: "tools: echo", lambda content: f"<{content}>")


@pytest.fixture
def every_turn_calls(monkeypatch):
    """Every turn of the tiny random model is a tool call (the run's format name, the test's syntax)."""
    monkeypatch.setitem(tf.FORMATS, "hermes", EVERY_TURN)


def write_task(tmp_path: Path, n: int = 8) -> Path:
    (tmp_path / "tools.py").write_text(TOOLS)
    rows = [{"prompt": f"say {w}:", "answer": w} for w in ("cat", "dog", "sun", "map", "red", "owl", "ink", "tea")[:n]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def tiny_tool_config(tmp_path: Path, *overrides: str):
    """The tiny model (character tokens, random weights) on a custom task whose model calls `echo` between turns."""
    write_task(tmp_path)
    (tmp_path / "config.yaml").write_text(f"""
model: {{path: tiny, tiny: {{hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, intermediate_size: 128,
        max_position: 256}}}}
task:
  name: custom
  params: {{path: {tmp_path / 'data.jsonl'}, answer_key: answer, tools: ['{tmp_path / 'tools.py'}:echo'],
           reward: ['{tmp_path / 'tools.py'}:said']}}
rollout: {{max_turns: 4, max_new_tokens: 24, max_total_tokens: 256, temperature: 1.0, group_size: 2}}
eval: {{num_prompts: 0}}
train: {{steps: 1, prompts_per_step: 4}}
""")
    return load_config(str(tmp_path / "config.yaml"), list(overrides))


CASES = [("fp32", False), ("bf16", False), ("unified", False), ("unified", True)]


@pytest.mark.parametrize("mode,kv_fp8", CASES)
def test_every_model_token_of_a_tool_conversation_equals_the_trainer(tmp_path, every_turn_calls, mode, kv_fp8):
    cfg = tiny_tool_config(tmp_path, f"precision.mode={mode}", f"precision.kv_cache_fp8={str(kv_fp8).lower()}",
                           "precision.numerics=exact")
    task = build_task(cfg)
    model, tok = build_policy(cfg)
    problems = [task.problem(i) for i in range(8)]
    prompts = [prompt_encoder(cfg, tok, task)(p) for p in problems]
    exp, trainer_lp, timings = paired_logprobs(cfg, model, tok, task, prompts, problems=problems)
    mask = exp.response_mask > 0
    assert max(s["turns"] for s in timings["turn_stats"]) == 4
    observed = (exp.attention_mask[:, exp.prompt_len:] & ~mask).sum()
    assert observed > 0, "no observation was appended"
    assert torch.equal(exp.rollout_logprobs[mask], trainer_lp[mask]), (
        f"{mode}: {int((exp.rollout_logprobs[mask] != trainer_lp[mask]).sum())} of {int(mask.sum())} differ")
