"""Trainer -> rollout weight hand-off: same bytes under unified, refusals for stale / foreign / corrupt updates."""

import pytest
import torch

from jetflow.config import derive, load_config
from jetflow.model import Decoder, ModelConfig
from jetflow.run.build import apply_mode, copy_model
from jetflow.precision import RecipeMismatchError, fp8_linears
from jetflow.sync import CorruptWeightsError, StaleWeightsError, apply_update, build_update


def tiny_pair(mode):
    cfg = load_config(None, [f"precision.mode={mode}", "precision.gemm_backend=emulate"])
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=32, tie_word_embeddings=True))
    rollout = apply_mode(copy_model(model), derive(cfg).precision, "rollout")
    apply_mode(model, derive(cfg).precision, "trainer")
    return cfg, model, rollout


def test_unified_ships_the_trainers_bytes_and_rollout_matches_trainer():
    cfg, trainer, rollout = tiny_pair("unified")
    fp = cfg.precision.recipe().fingerprint()
    update = build_update(trainer, "unified", version=0, fingerprint=fp, with_checksum=True)
    assert set(update.quantized) == set(fp8_linears(trainer)) and update.quantized
    # other matrices travel on the bf16 grid both sides compute them on; vectors as they are
    assert update.tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert update.tensors["model.norm.weight"].dtype == torch.float32
    assert apply_update(rollout, update, current_version=-1, fingerprint=fp) == 0
    for name, layer in fp8_linears(rollout).items():
        assert layer.quantized_weight() is update.quantized[name]  # the same bytes, not a requantization
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(trainer(ids), rollout(ids))


def test_mixed_rollout_differs_from_bf16_trainer():
    cfg, trainer, rollout = tiny_pair("mixed")
    update = build_update(trainer, "mixed", version=0)
    assert not update.quantized
    # matrices in bf16 (the grid both sides compute them on), vectors (norms) as the trainer has them
    assert all(t.dtype == (torch.bfloat16 if t.dim() >= 2 else torch.float32) for t in update.tensors.values())
    apply_update(rollout, update, -1, cfg.precision.recipe().fingerprint())
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        diff = (trainer(ids) - rollout(ids)).abs().max().item()
    assert diff > 1e-3  # FP8 rollout vs bf16 trainer: the mismatch the ablations measure


def test_stale_foreign_and_corrupt_updates_are_refused():
    cfg, trainer, rollout = tiny_pair("unified")
    fp = cfg.precision.recipe().fingerprint()
    update = build_update(trainer, "unified", version=3, fingerprint=fp)
    apply_update(rollout, update, -1, fp)
    with pytest.raises(StaleWeightsError):
        apply_update(rollout, update, 3, fp)
    newer = build_update(trainer, "unified", version=4, fingerprint=fp)
    with pytest.raises(RecipeMismatchError):
        apply_update(rollout, newer, 3, "0123456789ab")
    name = next(iter(newer.quantized))
    newer.quantized[name].scale_inv = torch.zeros_like(newer.quantized[name].scale_inv)
    with pytest.raises(CorruptWeightsError, match=name):
        apply_update(rollout, newer, 3, fp)
    checked = build_update(trainer, "unified", version=5, fingerprint=fp, with_checksum=True)
    checked.tensors["model.norm.weight"] = checked.tensors["model.norm.weight"] + 1
    with pytest.raises(CorruptWeightsError, match="checksum"):
        apply_update(rollout, checked, 4, fp)


def test_payload_fp8_is_smaller_than_bf16():
    _, trainer, _ = tiny_pair("unified")
    fp8 = build_update(trainer, "unified", 0, "x").nbytes()
    bf16 = build_update(trainer, "bf16", 0).nbytes()
    assert fp8 < bf16


def test_quantized_tensor_pickles_as_its_bytes_and_scales():
    """What Ray's object store and torch.save ship: the exact FP8 bytes and scales, no fp32 cache."""
    import pickle

    from jetflow.precision.quant import quantize_blocks
    q = quantize_blocks(torch.randn(200, 300), (128, 128)).with_dequantized_cache()
    back = pickle.loads(pickle.dumps(q))
    assert back.data.dtype == torch.float8_e4m3fn and back.block == (128, 128) and back.dequantized is None
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back.scale_inv, q.scale_inv)
    assert len(pickle.dumps(q)) < 200 * 300 * 2  # bytes + scales, not the 4-byte dequantized copy
