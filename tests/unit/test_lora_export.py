"""What a LoRA run leaves (issue 73): the PEFT directory, loaded by peft itself onto the Hugging Face base,
and the merged model, each giving the trainer's logits within the bound of fp32 summation order (and a
corrupted export out of it); the adapter-only checkpoint (the adapters and their AdamW state, nothing of
the frozen base) and a stopped-and-resumed run equal to the uninterrupted one, row for row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetflow.config import derive, load_config
from jetflow.export import merged_weights, write_lora_model
from jetflow.metrics_log import read_metrics
from jetflow.model import CheckpointError
from jetflow.model.checkpoint import save_hf_weights
from jetflow.model.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, jetflow_name, peft_name
from jetflow.precision.lora import adapter_parameters, is_adapter
from jetflow.run.build import apply_mode, build_model, build_policy, load_inputs, lora_adapter_config, with_lora
from jetflow.run.sides import TrainerSide
from jetflow.run.sources import resolve_model_dir
from crashes import kill_at_step

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
U = 2.0 ** -24  # fp32's unit roundoff
IDS = torch.tensor([[3, 14, 15, 42, 65, 35, 50, 79, 23, 8, 61, 17],
                    [2, 71, 82, 81, 82, 84, 59, 4, 9, 30, 11, 5]]) % 19  # the tiny model's vocabulary


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny fp32 LoRA trainer (rank 4 on the square q_proj / o_proj, alpha 16: scale 4) after three RL steps
    at a large learning rate, its base as a Hugging Face directory (the source's weights: the base is frozen),
    and its export (write_lora_model)."""
    cfg = load_config(TINY, ["precision.mode=fp32", "precision.numerics=fast", "model.lora.rank=4",
                             "model.lora.targets=[q_proj,o_proj]", "train.sft_warmup_steps=0", "eval.num_prompts=0",
                             "train.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
                             "train.lr=3e-2"])
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    loop = side.rl_loop()
    for step in range(3):
        loop.step(step)
    model = side.model
    assert all(bool(p.abs().max() > 0) for n, p in adapter_parameters(model).items() if n.endswith(".B"))
    source, _ = build_policy(cfg)
    state = {n: t for n, t in model.state_dict().items() if not is_adapter(n)}
    assert all(torch.equal(state[n], t) for n, t in source.state_dict().items())  # the base did not move
    out = tmp_path_factory.mktemp("lora-export")
    save_hf_weights(state, model.config, out / "base")
    write_lora_model(out / "run", model, side.tokenizer, "fp32", lora_adapter_config(cfg, model))
    return cfg, model, out


def _logits_and_bound(model, ids: torch.Tensor = IDS) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's logits on `ids` and the bound of an fp32 implementation of the same function computed in
    another summation order.

    Derivation. Every rounding error of fp32 is at most u = 2^-24 of the value rounded; a dot product of length
    K summed in another order differs by a random walk of K such errors, about u sqrt(K) sum_i |a_i b_i|
    (Higham's probabilistic bound; the worst case is u K). A logit is the dot product of the final hidden state
    h (K = hidden) with an lm_head row: its own sum contributes u sqrt(K) sum_i |h_i W_ji|, and every earlier
    reduction (per layer q/k/v/o, attention's two, gate/up/down, two norms: fewer than 16, each of length at
    most K = max(hidden, intermediate), 384 for the tiny model, and relative to the residual stream's size)
    reaches h as a relative error of the same order, u sqrt(K) each: the logit's error is at most
    (1 + 16 L) u sqrt(K) sum_i |h_i| |W_ji|, with a factor 4 for the few ulps a softmax / exp / rsqrt
    evaluates to. The LoRA path adds two dot products of lengths K and r per adapted linear, inside that count."""
    captured = {}
    hook = model.lm_head.register_forward_pre_hook(lambda m, args: captured.update(h=args[0].detach()))
    try:
        with torch.no_grad():
            logits = model(ids).float()
    finally:
        hook.remove()
    c = model.config
    k, ops = max(c.hidden_size, c.intermediate_size), 1 + 16 * c.num_layers
    magnitude = captured["h"].double().abs() @ model.lm_head.weight.detach().double().abs().t()
    bound = 4 * ops * U * (k ** 0.5) * magnitude
    return logits.double(), bound


def _excess(got: torch.Tensor, model, ids: torch.Tensor = IDS) -> float:
    """max |got - trainer| / bound: <= 1 inside the bound."""
    want, bound = _logits_and_bound(model, ids)
    return float(((got.double() - want).abs() / bound).max())


def _peft_logits(base_dir: Path, adapter_dir: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter_dir).eval()(ids).logits


def _corrupt(adapter_dir: Path, to: Path, change) -> Path:
    to.mkdir()
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    change(tensors, config)
    save_file(tensors, str(to / ADAPTER_WEIGHTS))
    (to / ADAPTER_CONFIG).write_text(json.dumps(config))
    return to


def test_peft_loads_the_adapters_onto_the_base_and_gives_the_trainers_logits(trained, tmp_path):
    """peft.PeftModel.from_pretrained(HF base, <run>/adapter) against the trainer's forward, within the bound of
    `_logits_and_bound`; the same export with its adapters transposed (B A -> A^T B^T: A := B^T, B := A^T, the
    shapes of a square linear's), its scale lost (lora_alpha = r) or two linears' B exchanged is far outside it
    (measured: PEFT's logits are the trainer's bit for bit, the same products in the same order; the corrupted
    ones 2,400-5,400 bounds away)."""
    cfg, model, out = trained
    adapter = out / "run" / "adapter"
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert {k: config[k] for k in ("peft_type", "r", "lora_alpha", "target_modules", "lora_dropout", "task_type",
                                   "bias", "base_model_name_or_path")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 16.0, "target_modules": ["o_proj", "q_proj"], "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM", "bias": "none", "base_model_name_or_path": None}
    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight" in tensors
    held = adapter_parameters(model)
    assert {jetflow_name(n) for n in tensors} == set(held)
    assert all(torch.equal(tensors[peft_name(n)], p.detach()) for n, p in held.items())

    assert _excess(_peft_logits(out / "base", adapter), model) <= 1

    def transposed(t, c):
        for name in [n for n in t if "lora_A" in n]:
            b = name.replace("lora_A", "lora_B")
            t[name], t[b] = t[b].t().contiguous(), t[name].t().contiguous()

    def unscaled(t, c):
        c["lora_alpha"] = c["r"]

    def exchanged(t, c):
        q = "base_model.model.model.layers.0.self_attn.{}_proj.lora_B.weight".format
        t[q("q")], t[q("o")] = t[q("o")], t[q("q")]

    for change in (transposed, unscaled, exchanged):
        wrong = _corrupt(adapter, tmp_path / change.__name__, change)
        assert _excess(_peft_logits(out / "base", wrong), model) > 10, change.__name__


def test_the_merged_model_is_the_trainers_and_model_dir_holds_it_in_bf16(trained, tmp_path):
    """W + scale B A (float64, rounded once) computes the trainer's W x + scale B (A x) within the same bound
    (transformers reads it); <run>/model holds exactly those weights in bf16, the adapters not among them; the
    merge with B A transposed is far outside the bound (measured: 0.002 of the bound, the wrong one 4,100)."""
    from transformers import AutoModelForCausalLM
    cfg, model, out = trained
    merged = merged_weights(model)
    assert not any(is_adapter(n) for n in merged)

    def hf_logits(weights, d):
        save_hf_weights(weights, model.config, d)
        with torch.no_grad():
            return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(IDS).logits

    assert _excess(hf_logits(merged, tmp_path / "merged"), model) <= 1
    written = load_file(str(out / "run" / "model" / "model.safetensors"))
    assert set(written) == set(merged) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert all(torch.equal(written[n], merged[n].to(torch.bfloat16)) for n in written)
    wrong = dict(merged)
    for name, layer in model.named_modules():
        if getattr(layer, "lora", None) is not None:
            delta = layer.lora.scale * (layer.lora.B.detach() @ layer.lora.A.detach())
            wrong[f"{name}.weight"] = layer.weight.detach() + delta.t()
    assert _excess(hf_logits(wrong, tmp_path / "wrong"), model) > 10


@pytest.mark.long  # about 40 s on the shared 2-core CPU: the real model loaded four times
def test_smollm2s_adapters_load_with_peft_onto_its_converted_base(smollm2_dir, tmp_path):
    """SmolLM2-135M (30 layers, the default targets, rank 16, B drawn so that the adapters matter): PEFT on the
    HF directory the run's base_model_name_or_path names gives the fp32 trainer's logits within the bound of
    `_logits_and_bound`; without the scale it does not (measured: 0.0 of the bound, PEFT's products being the
    trainer's; scaled 4x, 90 bounds away: the bound of 30 layers is loose)."""
    cfg = load_config(None, ["precision.mode=fp32", "precision.numerics=fast", "model.lora.rank=16",
                             f"model.cache_dir={smollm2_dir.parent}"])
    inputs = load_inputs(cfg)
    model = with_lora(apply_mode(build_model(cfg, inputs.arch, inputs.tokenizer), derive(cfg).precision, "trainer"),
                      cfg, "trainer")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in adapter_parameters(model).items():
            if name.endswith(".B"):
                p.normal_(0, 0.1, generator=gen)
    config = lora_adapter_config(cfg, model)
    assert config["base_model_name_or_path"] == str(smollm2_dir.resolve())
    write_lora_model(tmp_path, model, inputs.tokenizer, "fp32", config)
    ids = torch.tensor([inputs.tokenizer.encode("What is 7 + 5? Answer: 12")])
    adapter = tmp_path / "adapter"
    assert _excess(_peft_logits(smollm2_dir, adapter, ids), model, ids) <= 1
    wrong = _corrupt(adapter, tmp_path / "unscaled", lambda t, c: c.update(lora_alpha=c["r"] * 4))
    assert _excess(_peft_logits(smollm2_dir, wrong, ids), model, ids) > 10


# Adapter-only checkpoints -------------------------------------------------------------------------------

def _config(out: Path, *extra: str):
    return load_config(TINY, ["model.lora.rank=8", "precision.mode=unified", "precision.numerics=exact",
                              "train.steps=4", "train.sft_warmup_steps=0", "eval.num_prompts=0", "train.lr=1e-2",
                              "train.checkpoint_every=1", f"run.out_dir={out}", "run.name=r", "run.progress=false",
                              "run.loggers=[]", *extra])


def _without_clock(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in read_metrics(run_dir, "rl")]


def test_a_lora_checkpoint_holds_the_adapters_and_their_adam_state_and_a_resumed_run_is_the_uninterrupted_one(
        tmp_path, monkeypatch):
    """Unified, exact: a run killed in step 2 resumes from its step-2 checkpoint (the adapters as a PEFT directory,
    their AdamW moments, nothing of the frozen base, which the resume rebuilds from its source) and logs the
    uninterrupted run's rows (loss, gradient norm, rewards, mismatch: all but the clock and the sync's bytes, as
    the resumed engine gets the base again with its first update), then writes the same adapters and merged
    model; its base-fp8/ holds the trainer's FP8 bytes."""
    from jetflow.run.loop import RLLoop
    from jetflow.run.runner import train
    from jetflow.train.checkpoint import load_adapters

    whole = train(_config(tmp_path / "whole"))
    kill_at_step(monkeypatch, RLLoop, 2)
    with pytest.raises(SystemExit):
        train(_config(tmp_path / "cut"))
    monkeypatch.undo()
    checkpoint = tmp_path / "cut" / "r" / "checkpoints" / "step_000002"
    files = {f.name for f in checkpoint.iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "trainer.pt"} <= files and "model.safetensors" not in files
    cfg = _config(tmp_path / "probe")
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    adapters = adapter_parameters(side.model)
    assert set(load_file(str(checkpoint / ADAPTER_WEIGHTS))) == {peft_name(n) for n in adapters}
    frozen = [n for n, p in side.model.named_parameters() if not is_adapter(n)]
    assert frozen and not any(p.requires_grad for n, p in side.model.named_parameters() if n in frozen)
    moments = torch.load(checkpoint / "trainer.pt", weights_only=True)["optimizer"]["state"]
    shapes = sorted(tuple(p.shape) for p in adapters.values())
    assert sorted(tuple(s["exp_avg"].shape) for s in moments.values()) == shapes  # the adapters' and no other
    assert sorted(tuple(s["exp_avg_sq"].shape) for s in moments.values()) == shapes

    resumed = train(_config(tmp_path / "cut", "run.resume=true"))
    rows, want = _without_clock(resumed), _without_clock(whole)
    sync = [r.pop("sync/bytes") for r in rows]
    first, later = [want[0]["sync/bytes"], want[1]["sync/bytes"]]
    assert [r.pop("sync/bytes") for r in want] == [first, later, later, later] and sync == [first, later, first, later]
    assert len(rows) == 4 and rows == want and "train/loss" in rows[3] and "train/grad_norm" in rows[3]
    assert [r["mismatch/kl_k3"] for r in rows] == [0.0] * 4
    for d, f in (("adapter", ADAPTER_WEIGHTS), ("model", "model.safetensors"), ("base-fp8", "model.safetensors")):
        a, b = load_file(str(resumed / d / f)), load_file(str(whole / d / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), d
    load_adapters(whole / "adapter", side.model)  # the trained adapters on a freshly built trainer's base
    base = load_file(str(whole / "base-fp8" / "model.safetensors"))
    q = side.model.model.layers[0].self_attn.q_proj.quantized_weight()
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8), q.data.view(torch.uint8))
    merged = load_file(str(whole / "model" / "model.safetensors"))
    assert all(torch.equal(merged[n], t.to(torch.bfloat16)) for n, t in merged_weights(side.model).items()
               if n in merged)
    with pytest.raises(CheckpointError, match="holds LoRA adapters alone"):
        resolve_model_dir(whole / "checkpoints" / "step_000004")  # no model: the message says where it is
    assert resolve_model_dir(whole).weights_dir == whole / "model"  # the merged model


@pytest.mark.parametrize("change", ["norm", "fp8 byte"])
def test_a_resume_onto_another_base_than_the_adapters_were_trained_on_is_one_line(tmp_path, change):
    """The checkpoint keeps the frozen base's sha256 (jetflow.precision.lora.base_digest); a trainer whose
    rebuilt base differs (a norm weight, one FP8 byte of a linear) refuses it, the same base loads."""
    cfg = _config(tmp_path)
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    side.save(tmp_path / "r", 0, True)
    checkpoint = tmp_path / "r" / "checkpoints" / "step_000000"
    TrainerSide(cfg, derive(cfg), load_inputs(cfg)).restore(checkpoint)
    other = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    with torch.no_grad():
        if change == "norm":
            other.model.model.norm.weight[0] += 1
        else:
            data = other.model.model.layers[1].mlp.down_proj.quantized_weight().data.view(torch.uint8)
            data[0, 0] ^= 1
    with pytest.raises(CheckpointError, match="trained on another base") as e:
        other.restore(checkpoint)
    assert "\n" not in str(e.value)


def test_a_lora_run_killed_in_its_warm_up_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The supervised warm-up trains the adapters too (its own AdamW over them): killed in its step 2, the run
    resumes from warmup_000002 (adapters and the warm-up's moments) and logs the uninterrupted warm-up and RL
    rows, then writes the same adapters."""
    from jetflow.run.runner import train
    from jetflow.run.warmup import Warmup

    over = ("train.sft_warmup_steps=3", "train.sft_batch_size=8", "train.steps=1")
    whole = train(_config(tmp_path / "whole", *over))
    kill_at_step(monkeypatch, Warmup, 2)
    with pytest.raises(SystemExit):
        train(_config(tmp_path / "cut", *over))
    monkeypatch.undo()
    checkpoint = tmp_path / "cut" / "r" / "checkpoints" / "warmup_000002"
    assert (checkpoint / ADAPTER_WEIGHTS).is_file() and not (checkpoint / "model.safetensors").exists()
    resumed = train(_config(tmp_path / "cut", *over, "run.resume=true"))

    def rows(run: Path, phase: str) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "sync/bytes"))}
                for r in read_metrics(run, phase)]

    assert len(rows(whole, "sft")) == 3 and rows(resumed, "sft") == rows(whole, "sft")
    assert len(rows(whole, "rl")) == 1 and rows(resumed, "rl") == rows(whole, "rl")
    a, b = (load_file(str(run / "adapter" / ADAPTER_WEIGHTS)) for run in (resumed, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("changed", ["model.lora.alpha=32", "model.lora.rank=4", "model.lora.targets=[q_proj]"])
def test_a_resume_under_another_model_lora_is_one_line(tmp_path, changed):
    """rank, alpha (the scale, which the tensors do not carry) and the targets of a LoRA checkpoint against the
    resuming trainer's."""
    cfg = _config(tmp_path)
    TrainerSide(cfg, derive(cfg), load_inputs(cfg)).save(tmp_path / "r", 0, True)
    other = _config(tmp_path, changed)
    with pytest.raises(CheckpointError, match="was model.lora") as e:
        TrainerSide(other, derive(other), load_inputs(other)).restore(tmp_path / "r" / "checkpoints" / "step_000000")
    assert "\n" not in str(e.value)
