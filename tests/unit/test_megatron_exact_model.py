"""The Megatron trainer under exact numerics (MegatronPolicy(numerics="exact")) against the native exact
Decoder, in one process (TP = PP = EP = 1): logits `torch.equal`, dense and MoE, fp32 / bf16 / FP8, with
left padding and the FP8 K/V quantizer; the checks and the `auto` resolution are pure. TP=2, PP=2, EP=2
and the rollout engine: tests/integration/test_megatron_exact.py.
"""

import copy
import importlib.util

import pytest
import torch

from jetflow.config import ConfigError, derive, load_config
from jetflow.model import ModelConfig
from jetflow.precision import QuantRecipe, apply_precision
from jetflow.precision.kv import KVQuantizer, attach_kv_quantizer
from jetflow.train import megatron as jm
from test_megatron import CONFIGS, left_padded_batch, megatron_process_group, random_decoder  # noqa: F401  (the fixture)
from test_megatron_moe import CONFIGS as MOE_CONFIGS, FP8_CONFIG as MOE_FP8

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON,
                                    reason="megatron-core not installed (pip install megatron-core==0.16.1)")
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def native_and_policy(cfg: ModelConfig, kind: str, seed: int = 0, numerics: str = "exact"):
    """The native Decoder under `kind` and exact numerics, and a MegatronPolicy of the same weights."""
    base = random_decoder(cfg, seed)
    recipe = QuantRecipe()
    native = apply_precision(copy.deepcopy(base), kind, recipe, numerics="exact")
    native.numerics = "exact"
    policy = jm.MegatronPolicy.from_decoder(base, kind=kind, recipe=recipe, numerics=numerics)
    if kind != "fp32":  # the recipe keeps embeddings in bf16 (jetflow.run.build.embedding_grid)
        native.embed_grid = policy.embed_grid = torch.bfloat16
    return native, policy


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask)[mask]  # (real tokens, V)


@needs_megatron
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_exact_logits_equal_native(family, kind):
    """Llama 3 RoPE scaling / Qwen2 biases and tied embeddings / Qwen3 q-k norms, left-padded rows."""
    native, policy = native_and_policy(CONFIGS[family], kind)
    ids, mask = left_padded_batch(CONFIGS[family].vocab_size)
    assert torch.equal(logits(policy, ids, mask), logits(native, ids, mask))


@needs_megatron
def test_fast_numerics_are_not_the_native_exact_bits():
    """The control: Megatron's own attention and torch's GEMMs differ from the exact model in the last bits."""
    native, policy = native_and_policy(CONFIGS["llama"], "fp32", numerics="fast")
    ids, mask = left_padded_batch(CONFIGS["llama"].vocab_size)
    a, b = logits(policy, ids, mask), logits(native, ids, mask)
    assert not torch.equal(a, b) and (a - b).abs().max() < 1e-4


@needs_megatron
@pytest.mark.parametrize("family,kind", [("qwen3_moe", "fp32"), ("qwen3_moe_raw", "bf16"), ("qwen3_moe_mixed", "fp32"),
                                         ("mixtral", "fp32"), ("fp8", "fp8")])
def test_exact_moe_logits_equal_native(family, kind):
    """Megatron's MoE layer routes as the native exact block (softmax_exact, top-k, tree_sum renormalized)
    and sums a token's expert outputs in slot order; Mixtral routes each token to 3 of 4 experts."""
    cfg = MOE_FP8 if family == "fp8" else MOE_CONFIGS[family]
    native, policy = native_and_policy(cfg, kind)
    ids, mask = left_padded_batch(cfg.vocab_size)
    assert torch.equal(logits(policy, ids, mask), logits(native, ids, mask))


@needs_megatron
def test_moe_slot_order_is_what_makes_three_experts_exact(monkeypatch):
    """With Megatron's unpermute (a token's expert outputs summed in expert order) a top-3 model is off in
    the last bits; the slot-order combine gives the native bits."""
    cfg = MOE_CONFIGS["mixtral"]
    native, policy = native_and_policy(cfg, "fp32")
    g = torch.Generator().manual_seed(5)
    ids, mask = torch.randint(0, cfg.vocab_size, (8, 40), generator=g), torch.ones(8, 40, dtype=torch.bool)
    want = logits(native, ids, mask)
    assert torch.equal(logits(policy, ids, mask), want)
    monkeypatch.setattr(jm.moe._moe_classes()["dispatcher"], "slot_order", property(lambda self: False))
    assert not torch.equal(logits(policy, ids, mask), want)


@needs_megatron
def test_exact_fp8_kv_quantizer_equals_native():
    """The K/V quantizer after RoPE, where the native Attention applies it (scales set, unified)."""
    cfg = CONFIGS["qwen3"]
    native, policy = native_and_policy(cfg, "fp8")
    scales = {"k_scale": torch.full((cfg.num_layers,), 0.01), "v_scale": torch.full((cfg.num_layers,), 0.01)}
    quantizers = [KVQuantizer(cfg.num_layers) for _ in range(2)]
    for q in quantizers:
        q.load_scales(scales)
    attach_kv_quantizer(native, quantizers[0])
    assert policy.attach_kv_quantizer(quantizers[1]) is quantizers[1]  # one process: no model-parallel reduction
    ids, mask = left_padded_batch(cfg.vocab_size)
    with_kv = logits(policy, ids, mask)
    assert torch.equal(with_kv, logits(native, ids, mask))
    policy.attach_kv_quantizer(None)
    assert not torch.equal(logits(policy, ids, mask), with_kv)  # the quantizer was applied


@needs_megatron
def test_exact_positions_must_be_slots():
    _, policy = native_and_policy(CONFIGS["llama"], "fp32")
    ids = torch.randint(0, 61, (2, 6))
    with pytest.raises(ValueError, match="position_ids must be arange"):
        policy.forward_hidden(ids, position_ids=torch.arange(1, 7).expand(2, 6))


# ------------------------------------------------------------------------------------------------
# Pure: which tensor-parallel layouts can be exact, and what `auto` resolves to


def test_row_parallel_k_that_cannot_split_is_refused_naming_the_layer():
    tiny = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)  # configs/tiny.yaml: o_proj K = 128, one block
    with pytest.raises(jm.MegatronConfigError, match=r"^model\.layers\.0\.self_attn\.o_proj: a row-parallel K of 128"):
        jm.checks.check_exact_tp_split(tiny, 2)
    jm.checks.check_exact_tp_split(tiny, 2, numerics="fast")  # Megatron's all-reduce: no constraint
    wide = ModelConfig(vocab_size=64, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                       num_kv_heads=4, head_dim=64)  # configs/tiny-tp.yaml: 4 and 12 blocks, 4 groups each
    for tp in (1, 2, 4):
        jm.checks.check_exact_tp_split(wide, tp)
    with pytest.raises(jm.MegatronConfigError, match=r"o_proj.*tree_width\(512\) = 4.*tensor_parallel_size 8"):
        jm.checks.check_exact_tp_split(wide, 8)


@pytest.mark.parametrize("config,overrides,numerics", [
    ("tiny.yaml", ["train.backend=megatron"], "exact"),
    ("tiny.yaml", ["train.backend=megatron", "train.pipeline_parallel_size=2"], "exact"),
    ("tiny-moe.yaml", ["train.backend=megatron", "train.expert_parallel_size=2"], "exact"),
    ("tiny-tp.yaml", ["train.backend=megatron", "train.tensor_parallel_size=4"], "exact"),
    ("tiny.yaml", ["train.backend=megatron", "train.tensor_parallel_size=2"], "fast"),  # o_proj K = 128
])
def test_auto_numerics_with_megatron(config, overrides, numerics):
    assert derive(load_config(ROOT / "configs" / config, overrides)).precision.numerics == numerics


def test_exact_asked_where_tensor_parallelism_cannot_split_is_refused():
    from jetflow.run.validate import check_config
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 cannot split a row-parallel K of 128"):
        check_config(load_config(ROOT / "configs/tiny.yaml", ["train.backend=megatron", "train.tensor_parallel_size=2",
                                                              "precision.numerics=exact"]))
