"""Reward models (``model:DIR`` in task.params.reward): scored as TRL's GRPOTrainer scores them (checked
against transformers' own forward of each rendered text, one at a time), mixed with functions and weights,
counted in the memory estimate, and every bad input one line before any weight loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from jetflow.cli import main
from jetflow.config import derive, load_config
from jetflow.tasks import RewardError, make_task

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "reward_model"))
import make_reward_model as rm  # noqa: E402  (the example's builder: a tiny Llama sequence classifier)

ROWS = [{"prompt": f"reverse w{i}:", "answer": f"{i}w"} for i in range(1, 31)]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    chat = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in ROWS]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (tmp_path / "fn.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    rm.build(tmp_path / "rm", seed=3)
    return tmp_path


def reference_score(directory: Path, text: str) -> float:
    """transformers' own forward of one text, without padding: the independent reference."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])


def test_scores_are_the_models_first_logit_of_prompt_and_completion_mixed_with_a_function(workdir):
    task = make_task("custom", path="data.jsonl", reward=["model:rm", "fn.py:length"], reward_weights=[2.0, 0.5],
                     reward_model_batch_size=2)
    problems = [p for _, p in task.all_rows[:3]]
    completions = ["1w", "abcde", "x"]  # padded to 5 in a batch of 2: the padding must not change a score
    scores = task.score_batch(problems, completions)
    for p, c, s in zip(problems, completions, scores):
        expected = reference_score(workdir / "rm", p.prompt + c)  # TRL: a text prompt and completion concatenated
        assert s.parts["rm"] == pytest.approx(expected, abs=1e-5)
        assert s.total == pytest.approx(2.0 * expected + 0.5 * len(c), abs=1e-5)


def test_a_chat_prompt_is_rendered_by_the_reward_models_own_chat_template(workdir):
    tok = rm.char_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(workdir / "rm")
    task = make_task("custom", path="chat.jsonl", reward=["model:rm"])
    problem = task.all_rows[0][1]
    score = task.score_batch([problem], ["1w"])[0]
    assert score.total == pytest.approx(reference_score(workdir / "rm", "<user>reverse w1:<assistant>1w"), abs=1e-5)


def test_bfloat16_scores_are_near_float32(workdir):
    fp32 = make_task("custom", path="data.jsonl", reward=["model:rm"])
    bf16 = make_task("custom", path="data.jsonl", reward=["model:rm"], reward_model_dtype="bfloat16")
    problems = [p for _, p in fp32.all_rows[:4]]
    a = [s.total for s in fp32.score_batch(problems, ["1w", "2w", "aa", "zz"])]
    b = [s.total for s in bf16.score_batch(problems, ["1w", "2w", "aa", "zz"])]
    assert a != b and b == pytest.approx(a, abs=0.05)


def _causal_lm(directory: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=98, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(directory)
    rm.char_tokenizer().save_pretrained(directory)


def _edit_config(directory: Path, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage, message", [
    (lambda d: _causal_lm(d), r"holds a LlamaForCausalLM with no score head; a reward model is a "
                              r"\.\.\.ForSequenceClassification with num_labels=1"),
    (lambda d: _edit_config(d, id2label={"0": "bad", "1": "good"}), r"its score head has 2 labels"),
    (lambda d: _edit_config(d, vocab_size=50), r"its embedding has 98 rows and its config says vocab_size=50"),
    (lambda d: (d / "config.json").unlink(), r"no config.json in "),
    (lambda d: [f.unlink() for f in d.glob("*.safetensors")], r"no \*.safetensors weights in "),
], ids=["causal-lm", "two-labels", "embedding-vs-config", "no-config", "no-weights"])
def test_a_bad_reward_model_directory_is_one_line_before_any_weight_loads(workdir, damage, message, monkeypatch):
    damage(workdir / "rm")
    loads = []
    import transformers
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: loads.append(a))
    with pytest.raises(RewardError, match=rf"^reward model:rm: .*{message}") as e:
        make_task("custom", path="data.jsonl", reward=["model:rm"])
    assert "\n" not in str(e.value) and not loads


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(workdir):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    small = LlamaForSequenceClassification(LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1, num_labels=1, pad_token_id=0))
    small.save_pretrained(workdir / "rm")  # beside the 98-token tokenizer
    with pytest.raises(RewardError, match=r"^reward model:rm: its tokenizer has 98 tokens and the model vocab_size=60"):
        make_task("custom", path="data.jsonl", reward=["model:rm"])


def test_a_nan_score_names_the_row(workdir):
    from safetensors.torch import load_file, save_file

    weights = load_file(workdir / "rm" / "model.safetensors")
    weights["score.weight"][:] = float("nan")
    save_file(weights, workdir / "rm" / "model.safetensors", metadata={"format": "pt"})
    task = make_task("custom", path="data.jsonl", reward=["model:rm"])
    with pytest.raises(RewardError, match=r"^reward model:rm returned nan for the completion of row 1 of data.jsonl"):
        task.score_batch([task.all_rows[0][1]], ["1w"])


QUICK = ["train.steps=2", "train.sft_warmup_steps=0", "train.prompts_per_step=4", "rollout.group_size=4",
         "eval.num_prompts=0", "run.progress=false", "run.tensorboard=false", "run.num_threads=1"]


def _train_args(workdir, *more):
    return ["train", "--config", str(REPO / "examples/own_task/config.yaml"), "task.params.path=data.jsonl",
            "task.params.reward=[model:rm,fn.py:length]", "task.params.reward_weights=[1.0,0.1]",
            f"run.out_dir={workdir}", "run.name=rm", *QUICK, *more]


def test_a_run_with_a_reward_model_logs_its_score_and_time_and_a_nan_mid_run_keeps_the_steps_start(workdir, capsys):
    assert main(_train_args(workdir, "--no-report")) == 0
    rows = [json.loads(line) for line in (workdir / "rm" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert r["reward/mean"] == pytest.approx(r["reward/fn/rm"] + 0.1 * r["reward/fn/length"], abs=1e-5)
        assert r["time/reward"] > 0
    # NaN from the model: one line naming the row, the step's starting state checkpointed (as for a function)
    from safetensors.torch import load_file, save_file

    weights = load_file(workdir / "rm" / "model.safetensors")
    weights["score.weight"][:] = float("nan")
    save_file(weights, workdir / "rm" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(_train_args(workdir, "--no-report", "run.name=rm-nan")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jetflow: error: RewardError: reward model:rm returned nan for the completion of row ")
    assert "checkpointed at step 0" in err and (workdir / "rm-nan" / "checkpoints").is_dir()


def test_the_memory_estimate_counts_the_reward_model(workdir, monkeypatch):
    import jetflow.run.memory_estimate as me
    from jetflow.run.build import model_architecture
    from jetflow.run.validate import validate_run

    from transformers import AutoModelForSequenceClassification
    params = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(workdir / "rm").parameters())
    for dtype, width in [("float32", 4), ("bfloat16", 2)]:
        cfg = load_config(str(REPO / "examples/own_task/config.yaml"), _train_args(
            workdir, f"task.params.reward_model_dtype={dtype}")[3:])
        estimate = me.estimate_run(cfg, derive(cfg), model_architecture(cfg), 16)
        assert estimate.term("reward models") == params * width
    # too large for the memory by the reward model's weights: refused in one line before anything loads
    from jetflow.run.build import load_inputs
    need = me.estimate_run(cfg, derive(cfg), model_architecture(cfg), load_inputs(cfg).longest_prompt).total
    monkeypatch.setattr(me, "available_memory", lambda device: (need - params, "test"))
    with pytest.raises(me.MemoryTooSmall, match=r"^memory: this run needs about "):
        validate_run(cfg)


@pytest.mark.parametrize("key, value, message", [
    ("reward_model_dtype", "float16", r"^task.params.reward_model_dtype='float16': one of float32, bfloat16$"),
    ("reward_model_batch_size", 0, r"^task.params.reward_model_batch_size=0: at least 1$"),
])
def test_a_bad_scoring_setting_is_one_line(workdir, key, value, message):
    with pytest.raises(RewardError, match=message):
        make_task("custom", path="data.jsonl", reward=["model:rm"], **{key: value})
