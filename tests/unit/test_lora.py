"""LoRA on a frozen base (jetflow.precision.lora, model.lora): the adapted linear against an fp32 reference
within a derived bound, only the adapters trained, the frozen base's storage (FP8 bytes alone under unified,
bf16 under bf16), the weight sync (the base once, then the adapters alone, verified), the rollout engine's
log-probs equal to the trainer's bit for bit after optimizer steps that changed the adapters (fp32, bf16,
unified; exact numerics), a `jetflow train` run logging mismatch KL 0 on every step, and the one-line
refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from jetflow.cli import main
from jetflow.config import ConfigError, derive, load_config
from jetflow.precision import PrecisionLinear, QuantRecipe
from jetflow.precision.lora import adapter_parameters, apply_lora, is_adapter, lora_targets
from jetflow.run.build import apply_mode, blank_model, build_model, load_inputs, with_lora
from jetflow.run.sides import TrainerSide
from jetflow.run.validate import check_config, validate_run
from jetflow.sync import CorruptWeightsError, MissingBaseError, apply_update
from on_policy import assert_rollout_logprobs_equal_the_trainers

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
LORA = ["model.lora.rank=4", "train.sft_warmup_steps=0", "eval.num_prompts=0", "precision.numerics=exact"]
U = 2.0 ** -24  # fp32's unit roundoff


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


# The adapted linear ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_adapted_linear_is_the_base_plus_the_scaled_adapter_product_within_its_bound(kind, numerics):
    """layer(x) = base(x) + alpha / r * (x A^T) B^T: against the product in float64, within the bound of two
    fp32 dot products of lengths K and r (|err h| <= gamma_K |x| |A|^T, |err d| <= gamma_r |h| |B|^T + |err h|
    |B|^T), the scale's rounding and the final addition's."""
    gen = torch.Generator().manual_seed(0)
    k, n, r, alpha = 256, 96, 4, 16.0
    base = torch.nn.Linear(k, n)
    layer = PrecisionLinear.from_linear(base, kind=kind, recipe=QuantRecipe() if kind == "fp8" else None,
                                        numerics=numerics, name="proj")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].proj = layer
    (adapter,) = apply_lora(model, r, alpha, ["proj"], seed=0).values()
    with torch.no_grad():
        adapter.B.normal_(0, 0.1, generator=gen)
    x = torch.randn(3, 7, k, generator=gen)
    with torch.no_grad():
        got = layer(x).double()
        base_y = layer._base_forward(x).double()
    xa, A, B = x.double(), adapter.A.double(), adapter.B.double()
    d = (xa @ A.t()) @ B.t()
    eh = gamma(k) * (xa.abs() @ A.abs().t())
    ed = gamma(r) * ((xa.abs() @ A.abs().t() + eh) @ B.abs().t()) + eh @ B.abs().t()
    want = base_y + adapter.scale * d
    bound = adapter.scale * ed * (1 + U) + U * adapter.scale * d.abs() + U * want.abs() * (1 + U) + U * bound_floor(want)
    assert torch.all((got - want).abs() <= bound), float(((got - want).abs() / bound).max())
    assert not torch.equal(got, base_y)  # the adapter does add something


def bound_floor(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, 2.0 ** -126)  # below fp32's normal range nothing is relative


def test_a_adapter_starts_as_peft_draws_it_and_b_at_zero():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].q_proj = torch.nn.Linear(64, 32)
    (adapter,) = apply_lora(model, 8, 16.0, ["q_proj"], seed=1).values()
    assert isinstance(model.layers[0].q_proj, PrecisionLinear)  # an nn.Linear becomes the same fp32 computation
    assert adapter.scale == 2.0 and adapter.A.dtype == adapter.B.dtype == torch.float32
    assert torch.equal(adapter.B, torch.zeros(32, 8)) and adapter.A.abs().max() <= 1 / math.sqrt(64)
    want = torch.empty(8, 64)
    torch.nn.init.kaiming_uniform_(want, a=math.sqrt(5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(adapter.A.detach(), want)


def _trainer_model(mode: str, *overrides: str):
    cfg = load_config(TINY, [f"precision.mode={mode}", *LORA, *overrides])
    derived = derive(cfg)
    inputs = load_inputs(cfg)
    model = with_lora(apply_mode(build_model(cfg, inputs.arch, inputs.tokenizer), derived.precision, "trainer"),
                      cfg, "trainer")
    return cfg, derived, model


@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_only_the_adapters_train_and_the_base_keeps_its_modes_bytes(mode):
    from jetflow.train.trainer import Trainer
    cfg, _, model = _trainer_model(mode)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(n) for n in trained)
    assert set(trained) == set(adapter_parameters(model))
    assert len(lora_targets(model, cfg.model.lora.targets)) == 7 * cfg.model.tiny.num_layers
    trainer = Trainer(model, cfg.train, cfg.algo)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in adapter_parameters(model).values()}
    q = model.model.layers[0].self_attn.q_proj
    if mode == "unified":  # FP8 bytes and scales, no high-precision copy: a one-element placeholder
        assert q._loaded is not None and q.weight.stride() == (0, 0) and "weight" not in dict(q.named_parameters())
    else:
        assert q.weight.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)


# Weight sync ----------------------------------------------------------------------------------------------

def test_the_first_update_ships_the_base_and_later_ones_the_adapters_alone_verified():
    from jetflow.train.trainer import Trainer
    cfg, derived, model = _trainer_model("unified")
    fp = derived.precision.fingerprint
    trainer = Trainer(model, cfg.train, cfg.algo)
    first = trainer.weight_update("unified", fp)
    trainer.version += 1  # as an optimizer step does
    later = trainer.weight_update("unified", fp)
    adapters = adapter_parameters(model)
    adapter_bytes = sum(p.numel() * 4 for p in adapters.values())
    assert first.base and first.quantized and set(first.adapters) == set(adapters)
    assert first.nbytes() == later.nbytes() + sum(q.nbytes() for q in first.quantized.values()) + sum(
        t.numel() * t.element_size() for t in first.tensors.values())
    assert not later.base and not later.quantized and not later.tensors
    assert later.nbytes() == later.adapter_nbytes() == adapter_bytes
    later.checksum = later.compute_checksum()

    engine = with_lora(apply_mode(blank_model(cfg, model.config), derived.precision, "rollout"), cfg, "rollout")
    with pytest.raises(MissingBaseError, match="adapters alone"):
        apply_update(engine, later, -1, fp)  # before the base reached it
    version = apply_update(engine, first, -1, fp)
    tampered = type(later)(**{**later.__dict__, "adapters": {k: v + 1 for k, v in later.adapters.items()}})
    with pytest.raises(CorruptWeightsError, match="checksum"):
        apply_update(engine, tampered, version, fp)
    assert apply_update(engine, later, version, fp) == 1
    held = adapter_parameters(engine)
    assert all(torch.equal(held[n], p) for n, p in adapters.items())


# Exactness: the engine's log-probs against the trainer's, after steps that changed the adapters -----------

@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_rollout_logprobs_equal_the_trainers_after_steps_that_changed_the_adapters(mode):
    cfg = load_config(TINY, [f"precision.mode={mode}", *LORA, "train.prompts_per_step=4", "rollout.group_size=4",
                             "rollout.max_new_tokens=12", "train.lr=1e-2"])
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))
    loop = side.rl_loop()
    rows = [loop.step(step) for step in range(3)]
    adapters = adapter_parameters(side.model)
    assert any(bool(p.abs().max() > 0) for n, p in adapters.items() if n.endswith(".B"))  # B left zero
    assert [r["sync/bytes"] for r in rows[1:]] == [sum(p.numel() * 4 for p in adapters.values())] * 2
    assert all(r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0 for r in rows)
    loop.sync()  # the adapters of the last step
    assert_rollout_logprobs_equal_the_trainers(side, loop.rollout, cfg)


def test_a_lora_run_logs_mismatch_kl_zero_on_every_step(tmp_path):
    assert main(["train", "--config", TINY, "model.lora.rank=8", "precision.numerics=exact", "train.steps=4",
                 "train.sft_warmup_steps=0", "eval.num_prompts=0", f"run.out_dir={tmp_path}", "run.progress=false",
                 "run.loggers=[]"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "tiny/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/kl_k3" in r]
    assert len(rows) == 4
    assert all(r["mismatch/kl_k3"] == 0.0 and r["mismatch/kl_k1"] == 0.0 and r["mismatch/equal_frac"] == 1.0
               for r in rows)
    assert rows[1]["sync/bytes"] < rows[0]["sync/bytes"]  # the adapters alone after the first update


# Refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["model.lora.rank=-1"], "model.lora.rank=-1 is out of range; it must be >= 0"),
    (["model.lora.alpha=0"], "model.lora.alpha=0.0 is out of range; it must be > 0"),
    (["model.lora.dropout=0.1"], "off-policy by design"),
    (["train.backend=megatron", "train.pipeline_parallel_size=2"], "with train.backend=megatron and "
     "train.pipeline_parallel_size=2: LoRA on the Megatron trainer is built for tensor parallelism alone; use "
     "train.pipeline_parallel_size=1"),
    (["train.backend=fsdp", "train.data_parallel_shard_size=1"], "LoRA on FSDP shards nothing"),
    (["rollout.backend=vllm", "precision.numerics=fast"], "with rollout.backend=vllm and precision.numerics=fast "
     "(resolved: fast): LoRA in vLLM is built for jetflow's exact plugin only; use precision.numerics=exact"),
    (["run.orchestrator=ray"], "LoRA there is not built yet; use run.orchestrator=local"),
    (["algo.kl_coef=0.1"], "LoRA there is not built yet; use algo.kl_coef=0.0"),
    (["precision.family=mxfp8"], "is not built yet"),
    (["model.lora.targets=[]"], "model.lora.targets=[]"),
])
def test_what_lora_does_not_build_is_one_line_before_the_model_loads(overrides, message):
    cfg = load_config(TINY, ["model.lora.rank=8", *overrides])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.targets=[q_proj,x_proj]"], "model.lora.targets: 'x_proj' matches no linear of the model's decoder "
                                              "layers (its linears: down_proj, gate_proj, k_proj, o_proj, q_proj, "
                                              "up_proj, v_proj)"),
    (["model.lora.rank=65"], "model.lora.rank=65 is larger than model.layers.0.self_attn.k_proj's smaller "
                             "dimension 64 (128 in, 64 out); use a rank <= that"),
])
def test_targets_and_rank_are_checked_against_the_model_without_loading_it(tmp_path, overrides, message):
    cfg = load_config(TINY, ["model.lora.rank=8", f"run.out_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError) as e:
        validate_run(cfg)
    assert str(e.value) == message


def test_rank_zero_is_the_model_as_it_was():
    cfg = load_config(TINY, ["precision.numerics=exact"])
    derived = check_config(cfg)
    inputs = load_inputs(cfg)
    model = with_lora(apply_mode(build_model(cfg, inputs.arch, inputs.tokenizer), derived.precision, "trainer"),
                      cfg, "trainer")
    assert not adapter_parameters(model) and all(p.requires_grad for p in model.parameters())
