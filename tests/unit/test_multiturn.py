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


def vllm_or_skip() -> None:
    from jetflow.rollout.vllm import import_vllm
    try:
        import_vllm()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("backend", ["native", "vllm"])
@pytest.mark.parametrize("mode,kv_fp8", CASES)
def test_every_model_token_of_a_tool_conversation_equals_the_trainer(tmp_path, every_turn_calls, mode, kv_fp8, backend):
    """The native engine keeps each conversation's pages; vLLM (the exact plugin) gets each turn as a request of
    the conversation's ids (jetflow.rollout.turn_loop). Either way every sampled token's log-prob is the trainer's."""
    if backend == "vllm":
        vllm_or_skip()
    cfg = tiny_tool_config(tmp_path, f"precision.mode={mode}", f"precision.kv_cache_fp8={str(kv_fp8).lower()}",
                           "precision.numerics=exact", f"rollout.backend={backend}")
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


# --- the tool-call format, tools and environments: hand-made cases -----------------------------------------

def test_hermes_parses_calls_and_reports_malformed_ones():
    calls = tf.parse_hermes('x <tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call> y '
                            '<tool_call>{"name": oops}</tool_call><tool_call>[1, 2]</tool_call>')
    assert (calls[0].name, calls[0].arguments, calls[0].error) == ("multiply", {"a": 3, "b": 4}, None)
    assert calls[1].error.startswith("Error: the tool call is not valid JSON")
    assert calls[2].error.startswith("Error: a tool call must be a JSON object")
    assert tf.parse_hermes("no call here") == []
    with pytest.raises(ValueError, match="valid formats are hermes"):
        tf.tool_format("json")


def test_a_tool_that_raises_times_out_or_gets_bad_arguments_answers_with_an_error_text(tmp_path):
    import concurrent.futures

    from jetflow.tasks.tools import load_tools
    (tmp_path / "t.py").write_text(TOOLS + '''

def boom(x: int) -> int:
    """Fail.

    Args:
        x: Anything.
    """
    raise KeyError("nope")


async def later(x: int) -> dict:
    """Answer asynchronously.

    Args:
        x: A number.
    """
    return {"twice": 2 * x}
''')
    echo, slow, boom, later = load_tools([f"{tmp_path / 't.py'}:{n}" for n in ("echo", "slow", "boom", "later")])
    assert echo.schema["function"]["parameters"]["properties"]["text"]["type"] == "string"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert (echo.call({"text": "hi"}, 5, pool).content, echo.call({"text": "hi"}, 5, pool).error) == ("[hi]", False)
        assert later.call({"x": 3}, 5, pool).content == '{"twice": 6}'
        raised = boom.call({"x": 1}, 5, pool)
        assert raised.error and raised.content == "Error: boom raised KeyError: 'nope'"
        timed_out = slow.call({"text": "z"}, 0.1, pool)
        assert timed_out.error and "timed out after 0.1 s" in timed_out.content
        wrong = echo.call({"txt": "hi"}, 5, pool)
        assert wrong.error and "cannot take" in wrong.content
        assert echo.call([1], 5, pool).error


def test_tools_that_cannot_be_described_or_share_a_name_are_one_line(tmp_path):
    from jetflow.tasks.tools import ToolError, load_tools
    (tmp_path / "bad.py").write_text("def nodoc(x):\n    return x\n")
    with pytest.raises(ToolError, match=r"^tool .*bad.py:nodoc: its JSON schema cannot be made"):
        load_tools([f"{tmp_path / 'bad.py'}:nodoc"])
    (tmp_path / "t.py").write_text(TOOLS)
    with pytest.raises(ToolError, match="two tools are named echo"):
        load_tools([f"{tmp_path / 't.py'}:echo", f"{tmp_path / 't.py'}:echo"])
    with pytest.raises(ToolError, match="has no function 'missing'"):
        load_tools([f"{tmp_path / 't.py'}:missing"])


def test_an_environment_that_raises_or_answers_the_wrong_shape_is_one_line_naming_class_and_row(tmp_path):
    from jetflow.tasks.environment import EnvError, Environment, load_environment
    (tmp_path / "env.py").write_text('''
class Broken:
    def __init__(self, row):
        self.row = row

    def step(self, completion):
        if completion == "raise":
            raise RuntimeError("lost")
        return "only two", 1.0


class NoStep:
    pass
''')
    cls = load_environment(f"{tmp_path / 'env.py'}:Broken")
    env = Environment("env.py:Broken", cls, {"secret": 3}, "row 7 of games.jsonl")
    with pytest.raises(EnvError, match=r"^env env.py:Broken: step raised RuntimeError: lost on row 7 of games.jsonl$"):
        env.step("raise")
    with pytest.raises(EnvError, match=r"step returned tuple .* on row 7 of games.jsonl; it must return \(observation"):
        env.step("x")
    with pytest.raises(EnvError, match="class NoStep has no step"):
        load_environment(f"{tmp_path / 'env.py'}:NoStep")


# --- the engine: pages kept between turns, observations of any delay, the budget -------------------------

def engine_and_driver(tmp_path, *overrides: str):
    cfg = tiny_tool_config(tmp_path, "precision.mode=fp32", "precision.numerics=exact", *overrides)
    task = build_task(cfg)
    model, tok = build_policy(cfg)
    from jetflow.rollout.conversation import conversation_driver
    from jetflow.rollout.native import NativeRollout
    driver = conversation_driver(cfg, task, tok)
    rollout = NativeRollout(model, cfg, tok, [tok.eos_token_id], (), cfg.rollout.max_total_tokens, None, driver)
    problems = [task.problem(i) for i in range(8)]
    return rollout, driver, problems, [prompt_encoder(cfg, tok, task)(p) for p in problems]


def test_only_the_observations_are_prefilled_between_turns(tmp_path, every_turn_calls):
    """Page reuse: a turn's prefill is the model's last token and the observation, never the prefix again."""
    rollout, driver, problems, prompts = engine_and_driver(tmp_path)
    out = rollout.generate(prompts, list(range(8)), problems=problems)
    stats = rollout.engine.last_stats
    observations = [sum(1 for a, b in zip(m, m[1:] + [1]) if a == 0 and b == 1) for m in out.token_masks]
    observed_tokens = sum(len(m) - sum(m) for m in out.token_masks)
    assert stats["prefill_tokens"] == sum(map(len, prompts)) + observed_tokens + sum(observations)
    assert sum(observations) > 0 and stats["preemptions"] == 0


def test_a_slow_tool_stalls_only_its_own_conversation(tmp_path, every_turn_calls, monkeypatch):
    """Conversation 0's first observation is held back until the engine waits on it alone: the seven others go on
    decoding meanwhile and end (the engine does not wait on one conversation's tool), and only then does it wait.
    An engine that waited for the slow tool in its turn would never get there (the hold ends after 60 s)."""
    import concurrent.futures
    import threading

    from jetflow.rollout import parked as parked_module  # the engine's conversations wait there
    rollout, driver, problems, prompts = engine_and_driver(tmp_path, "rollout.max_turns=3")
    idle, held = threading.Event(), {"steps": 0, "released_by_idle": None}
    real_wait = parked_module.wait

    def waiting(futures, **kwargs):  # the engine blocks on observations only when nothing else can run
        if slow_called.is_set() and len(list(futures)) == 1:  # and only conversation 0 is left waiting
            idle.set()
        return real_wait(futures, **kwargs)
    monkeypatch.setattr(parked_module, "wait", waiting)
    decode = rollout.engine._decode_step

    def counted(*args):
        if slow_called.is_set() and held["released_by_idle"] is None:
            held["steps"] += 1
        return decode(*args)
    rollout.engine._decode_step = counted
    slow_called = threading.Event()
    after_turn = driver.after_turn

    def slow_first(index, turn_ids, reason):
        future = after_turn(index, turn_ids, reason)
        if index != 0 or future is None or slow_called.is_set():
            return future
        slow_called.set()
        late: concurrent.futures.Future = concurrent.futures.Future()

        def release():
            held["released_by_idle"] = idle.wait(60)
            late.set_result(future.result())
        threading.Thread(target=release, daemon=True).start()
        return late
    driver.after_turn = slow_first
    out = rollout.generate(prompts, list(range(8)), problems=problems)
    assert slow_called.is_set() and held["released_by_idle"] is True
    assert held["steps"] > 0  # the others decoded while conversation 0 waited for its tool
    assert out.token_masks[0].count(0) > 0  # and conversation 0 went on after its observation came


def tok_text(rollout, toks: list[int], mask: list[int]) -> str:
    """The text of a conversation's last run of model tokens."""
    start = max(j for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1]))
    return rollout.engine.tokenizer.decode(toks[start:], skip_special_tokens=True)


def test_a_conversation_that_reaches_max_total_tokens_ends_length_and_keeps_its_tokens(tmp_path, every_turn_calls):
    rollout, driver, problems, prompts = engine_and_driver(tmp_path, "rollout.max_total_tokens=40",
                                                            "rollout.max_new_tokens=24")
    out = rollout.generate(prompts, list(range(8)), problems=problems)
    for p, toks in zip(prompts, out.token_ids):
        assert len(p) + len(toks) <= 40
    assert "length" in out.finish_reasons
    assert all(len(t) == len(m) == len(lp) for t, m, lp in zip(out.token_ids, out.token_masks, out.logprobs))
    for conv, toks, mask, stats in zip(driver.conversations, out.token_ids, out.token_masks, out.turn_stats):
        # the messages the reward functions get follow the ids: a turn cut by the budget is the last message
        turns = [m for m in conv.messages if m["role"] == "assistant"]
        assert stats["turns"] == len(turns) == sum(1 for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1]))
        assert conv.messages[-1]["role"] == "assistant" and tok_text(rollout, toks, mask).endswith(turns[-1]["content"])


def test_an_environments_error_ends_generate_with_its_line(tmp_path):
    (tmp_path / "env.py").write_text('''
class Fails:
    def __init__(self, row):
        self.word = row["answer"]

    def step(self, completion):
        raise ValueError("bad " + self.word)
''')
    cfg_over = [f"task.params.env={tmp_path / 'env.py'}:Fails", "task.params.tools=null", "rollout.max_new_tokens=4"]
    rollout, driver, problems, prompts = engine_and_driver(tmp_path, *cfg_over)
    from jetflow.tasks.environment import EnvError
    with pytest.raises(EnvError, match=r"^env .*env.py:Fails: step raised ValueError: bad \w+ on row \d+ of "):
        rollout.generate(prompts, list(range(8)), problems=problems)


# --- token in, token out with a real chat template (SmolLM2's ChatML) ------------------------------------

def test_chatml_observations_close_the_turn_and_open_the_next(smollm2_dir):
    from jetflow.model.tokenizer import load_tokenizer
    from jetflow.rollout.turns import TurnRenderer
    tok = load_tokenizer(smollm2_dir)
    schema = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    r = TurnRenderer(tok, True, [schema], tf.FORMATS["hermes"])
    prompt = r.prompt_ids("hi")
    text = tok.decode(prompt)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "f"' in text  # ChatML has no tools=: a system message
    messages = r.observation_messages("tool", ["42"])
    after_eos = tok.decode(r.observation_ids(messages, turn_ended_with_eos=True))
    after_stop = tok.decode(r.observation_ids(messages, turn_ended_with_eos=False))
    assert after_eos == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert after_stop == "<|im_end|>" + after_eos
    # the whole conversation, appended as ids, is what message mode renders when the turn tokenizes back to itself
    turn = tok.encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + [tok.eos_token_id]
    answer = tok.encode("It is 42.") + [tok.eos_token_id]
    trained = prompt + turn + r.observation_ids(messages, True) + answer
    assistant = [{"role": "assistant", "content": tok.decode(t, skip_special_tokens=True)} for t in (turn, answer)]
    again = r.message_mode_ids("hi", assistant[:1] + messages + assistant[1:])
    from jetflow.rollout.turns import retokenized_differs
    assert not retokenized_differs(trained, again, True, frozenset([tok.eos_token_id]))
    other = tok.encode("I") + tok.encode("t is 42.") + [tok.eos_token_id]  # the same text as `answer`, other ids
    split = prompt + turn + r.observation_ids(messages, True) + other  # what message mode would not train on
    assert split != trained and retokenized_differs(split, again, True, frozenset([tok.eos_token_id]))


# --- the config: one line each --------------------------------------------------------------------------

def test_multi_turn_keys_that_cannot_run_are_refused_in_one_line(tmp_path):
    from jetflow.config import ConfigError
    from jetflow.run.validate import check_config
    with pytest.raises(ConfigError, match=r"^rollout.max_turns=3: a multi-turn rollout needs something to answer"):
        check_config(load_config(str(ROOT / "configs/tiny.yaml"), ["rollout.max_turns=3"]))
    with pytest.raises(ConfigError, match=r"^task.params.tools answers the model between turns, and rollout.max_turns=1"):
        check_config(tiny_tool_config(tmp_path, "rollout.max_turns=1"))
    with pytest.raises(ConfigError, match=r"^rollout.max_turns=0 is not valid|rollout.max_turns=0"):
        check_config(tiny_tool_config(tmp_path, "rollout.max_turns=0"))
    with pytest.raises(ConfigError, match=r"^rollout.max_total_tokens=20 holds a conversation"):
        check_config(tiny_tool_config(tmp_path, "rollout.max_total_tokens=20"))
    with pytest.raises(ConfigError, match=r"^run.orchestrator=ray with rollout.max_turns=4: multi-turn rollouts run in"):
        check_config(tiny_tool_config(tmp_path, "run.orchestrator=ray"))


# --- the turn-by-turn loop of engines that take token-id prompts (vLLM): hand-made cases ------------------

class _Driver:
    """Answers every turn with observation [7, 7] until a conversation has had `turns` turns."""

    def __init__(self, turns: int):
        self.turns, self.seen = turns, {}

    def after_turn(self, index, turn_ids, reason):
        import concurrent.futures
        self.seen[index] = self.seen.get(index, 0) + 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result([7, 7] if self.seen[index] < self.turns else None)
        return future


def test_the_turn_loop_appends_observations_as_ids_and_ends_at_the_budget():
    """Each turn the engine gets the conversation's whole context; its new tokens (mask 1, their log-probs) and
    the observation's ids (mask 0, log-prob 0.0) are appended as they are; a turn that reaches its limit ends the
    conversation "length", and so does an observation that leaves no room for one more token."""
    from jetflow.rollout.turn_loop import generate_by_turns, turn_seed
    calls = []

    def generate_turn(contexts, seeds, limits):  # every request samples 3 tokens [1, 2, 3] then stops
        calls.append((contexts, seeds, limits))
        n = [min(3, m) for m in limits]
        return [[1, 2, 3][:k] for k in n], [[-0.5] * k for k in n], ["stop" if k == 3 else "length" for k in n]

    prompts = [[9], [9, 9, 9, 9, 9, 9, 9, 9]]
    tokens, lps, masks, reasons = generate_by_turns(generate_turn, _Driver(turns=3), prompts, [5, 6],
                                                    max_new_tokens=4, max_total_tokens=16)
    assert tokens[0] == [1, 2, 3, 7, 7, 1, 2, 3, 7, 7, 1, 2, 3] and reasons[0] == "stop"  # three turns, then over
    assert masks[0] == [1, 1, 1, 0, 0] * 2 + [1, 1, 1] and lps[0] == ([-0.5] * 3 + [0.0] * 2) * 2 + [-0.5] * 3
    # conversation 1: 8 + 3 + 2 = 13 after one turn, 13 + 3 = 16 after the second: the observation does not fit
    assert tokens[1] == [1, 2, 3, 7, 7, 1, 2, 3] and reasons[1] == "length"
    assert calls[0] == ([[9], [9] * 8], [turn_seed(5, 0), turn_seed(6, 0)], [4, 4])
    assert calls[1] == ([[9, 1, 2, 3, 7, 7], [9] * 8 + [1, 2, 3, 7, 7]], [turn_seed(5, 1), turn_seed(6, 1)], [4, 3])
    assert turn_seed(5, 0) == 5 and len({turn_seed(5, t) for t in range(4)}) == 4
    with pytest.raises(ValueError, match="leaves no room in max_total_tokens=16"):
        generate_by_turns(generate_turn, _Driver(1), [[9] * 16], [0], 4, 16)
