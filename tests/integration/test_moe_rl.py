"""RL on a tiny random Qwen3-MoE (configs/tiny-moe.yaml): the three precision modes end to end, routing
replay in the loop, the router flip rate of `jetflow bench mismatch`, the load-balancing loss in the
trainer, and the Megatron refusal."""

import json
from pathlib import Path

import pytest
import torch

from jetflow.config import load_config
from jetflow.metrics_log import read_metrics
from jetflow.run.runner import train

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "configs/tiny-moe.yaml"
FAST = ["train.sft_warmup_steps=20", "train.prompts_per_step=4", "rollout.group_size=4", "run.progress=false",
        "run.tensorboard=false", "run.num_threads=1", "train.steps=2"]


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    return {mode: train(load_config(MOE, [f"run.out_dir={out}", *FAST, f"precision.mode={mode}", f"run.name={mode}"]))
            for mode in ("bf16", "mixed", "unified")}


def test_each_mode_trains_unified_exactly_on_policy(mode_runs):
    for mode, run_dir in mode_runs.items():
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == [0, 1], mode
        for r in rows:
            assert r["loss/router_aux"] > 0 and r["loss/router_aux"] == r["loss/router_aux"], mode  # logged, finite
            if mode in ("bf16", "unified"):  # exact numerics: one computation on both sides, routers included
                assert r["mismatch/kl_k3"] == 0.0 and r["mismatch/equal_frac"] == 1.0, (mode, r["step"])
            else:
                assert r["mismatch/kl_k3"] > 0 and r["mismatch/equal_frac"] < 1.0
        hf = json.loads((run_dir / "model" / "config.json").read_text())
        assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_experts"] == 4


def test_mixtral_trains_unified_exactly_on_policy(tmp_path):
    """The same loop on a tiny Mixtral (model.tiny.moe_family): its names, one intermediate size, no q/k norms."""
    run_dir = train(load_config(MOE, [f"run.out_dir={tmp_path}", *FAST, "model.tiny.moe_family=mixtral",
                                      "algo.routing_replay=true"]))
    for r in read_metrics(run_dir):
        assert r["mismatch/kl_k3"] == 0.0 and r["moe/router_flip_frac"] == 0.0 and r["loss/router_aux"] > 0
    hf = json.loads((run_dir / "model" / "config.json").read_text())
    assert hf["architectures"] == ["MixtralForCausalLM"] and hf["num_local_experts"] == 4
    assert hf["intermediate_size"] == 128
    from safetensors import safe_open
    with safe_open(str(run_dir / "model-fp8" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.experts.3.w2.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.block_sparse_moe.gate.weight").get_dtype() == "BF16"


def test_routing_replay_in_the_loop(tmp_path):
    """algo.routing_replay: the trainer routes by the rollout's recorded experts and logs how often its
    own router disagreed: never under unified (exact numerics), and the run still exactly on-policy."""
    for mode in ("unified", "mixed"):
        run_dir = train(load_config(MOE, [f"run.out_dir={tmp_path}", *FAST, f"precision.mode={mode}",
                                          f"run.name={mode}", "algo.routing_replay=true"]))
        for r in read_metrics(run_dir):
            assert 0.0 <= r["moe/router_flip_frac"] <= 1.0, mode
            if mode == "unified":
                assert r["moe/router_flip_frac"] == 0.0 and r["mismatch/kl_k3"] == 0.0


def test_routing_replay_refusals(tmp_path):
    from jetflow.config import ConfigError
    from jetflow.run.validate import validate_run

    with pytest.raises(ConfigError, match="native rollout engine and trainer only"):
        validate_run(load_config(MOE, ["algo.routing_replay=true", "rollout.backend=vllm"]))
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        train(load_config(ROOT / "configs/tiny.yaml", [f"run.out_dir={tmp_path}", *FAST, "algo.routing_replay=true"]))


def test_the_final_model_loads_in_transformers(mode_runs):
    from transformers import AutoModelForCausalLM

    from jetflow.model import load_hf_dir

    model_dir = mode_runs["bf16"] / "model"
    ours = load_hf_dir(model_dir)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 7, 9, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)


def test_bench_mismatch_router_flips(tmp_path):
    from jetflow.bench.mismatch import run

    payload = run(str(MOE), (), num_prompts=4, group_size=2, out_dir=str(tmp_path), name="moe")
    rows = {r["mode"]: r for r in payload["rows"]}
    assert rows["unified"]["kl_k3"] == 0.0 and rows["unified"]["router_flip_frac"] == 0.0
    assert rows["bf16"]["router_flip_frac"] == 0.0
    assert rows["mixed"]["kl_k3"] > 0 and rows["mixed"]["router_flip_frac"] > 0
    assert "router_flip_frac" in (tmp_path / "moe.md").read_text()


def test_load_balancing_loss_counts_the_same_tokens_in_exact_numerics():
    """Exact numerics realign padded rows before the layers: the loss must still leave out the padding
    (Decoder.last_token_mask follows the realignment). Same tokens, same set of router logits: equal sums."""
    from jetflow.model.decoder import Decoder, ModelConfig
    from jetflow.model.moe import load_balancing_loss, model_load_balancing_loss, router_logits
    from jetflow.precision import apply_precision

    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True)
    model = Decoder(cfg)
    ids = torch.randint(0, 64, (3, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        model.forward_hidden(ids, attention_mask=mask)  # fast numerics: rows as given
        fast = model_load_balancing_loss(model)
        by_hand = load_balancing_loss(router_logits(model), 4, 2, attention_mask=mask)
        unmasked = load_balancing_loss(router_logits(model), 4, 2)
        apply_precision(model, "fp32", numerics="exact")
        model.numerics = "exact"
        model.forward_hidden(ids, attention_mask=mask)  # rows realigned inside
        exact = model_load_balancing_loss(model)
    assert torch.equal(fast, by_hand) and not torch.allclose(fast, unmasked)
    assert torch.allclose(exact, fast, atol=1e-6, rtol=0)


def test_megatron_takes_moe_without_tensor_parallelism():
    """The Megatron backend builds MoE models (tests/unit/test_megatron_moe.py), with TP = 1 only."""
    from jetflow.run.build import build_policy
    from jetflow.train.megatron.checks import MegatronConfigError, check_supported

    cfg = load_config(MOE, [])
    model, _ = build_policy(cfg)
    check_supported(model.config, ep=2)
    with pytest.raises(MegatronConfigError, match="sequence parallelism"):
        check_supported(model.config, tp=2)
