"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral) against Hugging Face transformers, in fp32.

Tiny random Qwen3MoeForCausalLM (8 experts, top-2, renormalized; and a variant with a dense layer 0
via mlp_only_layers, no renormalization) and MixtralForCausalLM (4 experts, top-2) are saved with
`save_pretrained` and loaded with `jetflow.model.load`. Checked: config round trips, state-dict keys
equal the on-disk checkpoint keys, logits, jetflow's save read back by transformers, transformers'
fused in-memory layout, the load-balancing loss, batch invariance under exact numerics (a row alone
vs in a batch, full forward vs prefill + cached decode), what apply_precision does to routers and
experts, and routing replay.
"""

import json

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import jetflow.model as jm
from jetflow.model import ModelConfig, UnsupportedModelError, save_hf_dir
from jetflow.model.moe import (
    SparseMoeBlock,
    load_balancing_loss,
    moe_blocks,
    router_logits,
    softmax_exact,
    tree_sum,
)
from jetflow.precision import QuantRecipe, apply_precision
from jetflow.precision.linear import PrecisionLinear

TOL_HF = 1e-5
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=256)
FAMILIES = ["qwen3_moe", "qwen3_moe_dense0", "mixtral"]


def build_hf(family: str):
    """A tiny random transformers MoE causal LM in fp32, every parameter perturbed (so that routers
    are not near-uniform and norms are not ones)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, head_dim=16, moe_intermediate_size=32,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen3_moe_dense0":
        cfg = tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, head_dim=16, moe_intermediate_size=32,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0])
        cls = tf.Qwen3MoeForCausalLM
    else:
        cfg = tf.MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            hf = build_hf(family)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            built[family] = (hf, path)
        return built[family]

    return get


@pytest.fixture(params=FAMILIES)
def pair(request, hf_dirs):
    hf, path = hf_dirs(request.param)
    return hf, jm.load(path), path


def ids_batch(B=3, T=12, seed=0):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------
# config


def test_config_fields_and_round_trip(hf_dirs):
    import transformers as tf

    for family in FAMILIES:
        _, path = hf_dirs(family)
        hf_cfg = json.loads((path / "config.json").read_text())
        c = ModelConfig.from_hf(hf_cfg)
        assert c.is_moe and c.num_experts_per_tok == 2
        assert ModelConfig.from_hf(c.to_hf()) == c
        back = tf.AutoConfig.for_model(**c.to_hf())  # transformers reads what jetflow writes
        if family == "mixtral":
            assert (c.num_experts, c.moe_intermediate_size, c.norm_topk_prob, c.qk_norm) == (4, 64, True, False)
            assert c.moe_attr == "block_sparse_moe" and c.to_hf()["num_local_experts"] == 4
            assert back.num_local_experts == 4 and back.sliding_window is None
        else:
            assert (c.num_experts, c.moe_intermediate_size, c.qk_norm) == (8, 32, True)
            # transformers 5 writes `num_local_experts`; jetflow writes the released checkpoints' key
            assert "num_local_experts" in hf_cfg and c.to_hf()["num_experts"] == 8
            assert "num_local_experts" not in c.to_hf()
            assert back.num_experts == 8 and back.moe_intermediate_size == 32
            assert back.norm_topk_prob == c.norm_topk_prob
            assert list(back.mlp_only_layers) == list(c.mlp_only_layers)
        assert back.num_experts_per_tok == 2 and back.router_aux_loss_coef == c.router_aux_loss_coef
        assert [c.is_moe_layer(i) for i in range(2)] == ([False, True] if family == "qwen3_moe_dense0" else [True, True])


@pytest.mark.parametrize("change,match", [
    ({"sliding_window": 64}, "sliding_window"),
    ({"router_jitter_noise": 0.1}, "jitter"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_unsupported_mixtral_settings(hf_dirs, change, match):
    _, path = hf_dirs("mixtral")
    hf_cfg = {**json.loads((path / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(hf_cfg)


@pytest.mark.parametrize("change,match", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers"),
    ({"use_sliding_window": True}, "sliding"),
])
def test_unsupported_qwen3_moe_settings(hf_dirs, change, match):
    _, path = hf_dirs("qwen3_moe")
    hf_cfg = {**json.loads((path / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(hf_cfg)


def test_decoder_sparse_step_picks_layers():
    c = ModelConfig(model_type="qwen3_moe", num_layers=4, num_experts=4, num_experts_per_tok=1,
                    moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not ModelConfig(model_type="qwen3").is_moe_layer(0)


# ------------------------------------------------------------------------------------------------
# checkpoints and parity with transformers


@torch.no_grad()
def test_state_dict_keys_equal_checkpoint_keys(pair):
    _, model, path = pair
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == on_disk
    if model.config.model_type == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in on_disk
    else:
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in on_disk


@torch.no_grad()
def test_logits_match_hf(pair):
    hf, model, _ = pair
    ids = ids_batch()
    assert max_diff(model(ids), hf(ids).logits) <= TOL_HF


@torch.no_grad()
def test_left_padded_rows_match_hf(hf_dirs):
    hf, path = hf_dirs("qwen3_moe")
    model = jm.load(path)
    ids = ids_batch(2, 10, seed=5)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :4] = False
    out = model(ids, attention_mask=mask)
    assert max_diff(out[0, 4:], hf(ids[:1, 4:]).logits[0]) <= TOL_HF
    assert max_diff(out[1], hf(ids[1:]).logits[0]) <= TOL_HF


@torch.no_grad()
def test_jetflow_save_is_read_by_transformers(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, model, _ = pair
    out = save_hf_dir(model, tmp_path / "saved")
    hf2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf2) is type(hf)
    ids = ids_batch(seed=1)
    assert max_diff(hf2(ids).logits, hf(ids).logits) <= TOL_HF
    again = jm.load(out)
    assert again.config == model.config
    assert torch.equal(again(ids), model(ids))


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_loads_transformers_fused_layout(hf_dirs, tmp_path, family):
    """transformers' in-memory layout (fused gate_up_proj / down_proj, Mixtral's block as `mlp`)."""
    hf, _ = hf_dirs(family)
    hf.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    model = jm.load(tmp_path)
    ids = ids_batch(seed=2)
    assert max_diff(model(ids), hf(ids).logits) <= TOL_HF


# ------------------------------------------------------------------------------------------------
# router logits and the load-balancing loss


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_load_balancing_loss_matches_transformers(hf_dirs, family):
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    hf, path = hf_dirs(family)
    model = jm.load(path)
    c = model.config
    ids = ids_batch(3, 10, seed=3)
    ref = hf(ids, output_router_logits=True)
    model(ids)
    ours = router_logits(model)
    assert len(ours) == len(ref.router_logits) == 2
    for a, b in zip(ours, ref.router_logits):
        assert a.shape == (30, c.num_experts) and max_diff(a, b) <= TOL_HF
    hf_loss = load_balancing_loss_func(ref.router_logits, c.num_experts, c.num_experts_per_tok)
    assert torch.allclose(load_balancing_loss(ours, c.num_experts, c.num_experts_per_tok), hf_loss, rtol=1e-5)
    assert torch.allclose(hf_loss, ref.aux_loss, rtol=1e-6)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, 7:] = 0
    hf_masked = load_balancing_loss_func(ref.router_logits, c.num_experts, c.num_experts_per_tok, mask)
    ours_masked = load_balancing_loss(ours, c.num_experts, c.num_experts_per_tok, mask)
    assert torch.allclose(ours_masked, hf_masked, rtol=1e-5) and not torch.allclose(ours_masked, hf_loss)


def test_router_and_experts_get_gradients(hf_dirs):
    _, path = hf_dirs("mixtral")
    model = jm.load(path).train()
    c = model.config
    logits = model(ids_batch(2, 8))
    loss = logits.float().logsumexp(-1).mean() + load_balancing_loss(router_logits(model), c.num_experts,
                                                                      c.num_experts_per_tok)
    loss.backward()
    block = model.model.layers[0].block_sparse_moe
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    used = block.last_topk_ids.unique().tolist()
    assert all(block.experts[e].w1.weight.grad is not None for e in used)


def test_exact_softmax_and_tree_sum():
    x = torch.randn(7, 13, dtype=torch.float64)
    assert torch.allclose(tree_sum(x)[:, 0], x.sum(-1))
    assert torch.allclose(softmax_exact(x), torch.softmax(x, -1))
    assert torch.equal(softmax_exact(x.float())[2:3], softmax_exact(x.float()[2:3]))


# ------------------------------------------------------------------------------------------------
# exact numerics: batch invariance


def exact_model(path, kind="fp32"):
    model = jm.load(path)
    model.numerics = "exact"
    return apply_precision(model, kind, QuantRecipe() if kind == "fp8" else None, gemm_backend="auto",
                           numerics="exact")


@torch.no_grad()
@pytest.mark.parametrize("family,kind", [("qwen3_moe", "fp32"), ("mixtral", "fp32"), ("qwen3_moe_dense0", "fp8")])
def test_exact_numerics_batch_invariant(hf_dirs, family, kind):
    """Under exact numerics a row's logits are the same bits alone and inside a batch (whose other
    rows route elsewhere), and a full forward equals prefill + cached decode."""
    _, path = hf_dirs(family)
    model = exact_model(path, kind)
    ids = ids_batch(4, 12, seed=4)
    full = model(ids)  # (4, 12, V)
    for b in (0, 3):
        assert torch.equal(model(ids[b:b + 1])[0], full[b]), f"row {b} alone differs from in the batch"
    assert torch.equal(model(ids[1:3]), full[1:3])
    cache = model.new_cache(batch_size=4, max_len=12)
    parts = [model(ids[:, :5], cache=cache)]
    for t in range(5, 12):
        parts.append(model(ids[:, t:t + 1], cache=cache))
    assert torch.equal(torch.cat(parts, dim=1), full)


# ------------------------------------------------------------------------------------------------
# precision conversion, module calls, routing replay


def test_fp8_keeps_routers_high_precision(hf_dirs):
    _, path = hf_dirs("qwen3_moe_dense0")
    model = apply_precision(jm.load(path), "fp8", QuantRecipe(), gemm_backend="emulate")
    kinds = {n: m.kind for n, m in model.named_modules() if isinstance(m, PrecisionLinear)}
    routers = [n for n in kinds if n.endswith(".mlp.gate")]
    assert routers == ["model.layers.1.mlp.gate"]
    assert all(kinds[n] == "bf16" for n in routers)  # the recipe's high-precision kind, never fp8
    experts = [n for n in kinds if ".experts." in n]
    assert len(experts) == 8 * 3 and all(kinds[n] == "fp8" for n in experts)
    assert kinds["model.layers.0.mlp.gate_proj"] == "fp8"  # a dense MLP's gate_proj is not a router
    _, mixtral_path = hf_dirs("mixtral")
    mixtral = apply_precision(jm.load(mixtral_path), "fp8", QuantRecipe(), gemm_backend="emulate")
    for layer in mixtral.model.layers:
        assert layer.block_sparse_moe.gate.kind == "bf16" and layer.block_sparse_moe.experts[0].w2.kind == "fp8"
    with torch.no_grad():
        assert torch.isfinite(model(ids_batch(1, 6))).all() and torch.isfinite(mixtral(ids_batch(1, 6))).all()


def test_every_linear_is_called_as_a_module(hf_dirs):
    _, path = hf_dirs("mixtral")
    model = jm.load(path)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(names) == 2 * (4 + 1 + 4 * 3) + 1
    called = set()
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, inp, out, n=n: called.add(n))
    with torch.no_grad():
        model(ids_batch(4, 16))
    assert called == set(names)


@torch.no_grad()
def test_routing_replay(hf_dirs):
    _, path = hf_dirs("qwen3_moe")
    block = moe_blocks(jm.load(path))[0]
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(6))
    out = block(x)
    chosen = block.last_topk_ids.clone()  # (18, 2)
    assert chosen.shape == (18, 2)
    assert torch.equal(block(x, routed_ids=chosen.view(2, 9, 2)), out)
    # another routing: weights are the router's probabilities at the forced ids, renormalized
    forced = (chosen + 1) % 8
    got = block(x, routed_ids=forced)
    assert torch.equal(block.last_topk_ids, forced)
    x2 = x.reshape(-1, 64)
    probs = torch.softmax(block.gate(x2), -1, dtype=torch.float32).gather(-1, forced)
    weights = probs / probs.sum(-1, keepdim=True)
    ref = sum(weights[:, k, None] * torch.stack([block.experts[e](x2[i:i + 1])[0] for i, e in enumerate(forced[:, k])])
              for k in range(2))
    assert max_diff(got.reshape(-1, 64), ref) <= 1e-6
    with pytest.raises(ValueError, match="routed_ids"):
        block(x, routed_ids=forced[:, :1])
