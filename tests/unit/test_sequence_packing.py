"""Sequence packing (train.max_tokens_per_micro_batch, jetflow.train.packing), against the padded path as
the reference: under exact numerics the log-probs and entropies are torch.equal (fp32, bf16, unified, with
chunked log-probs and activation checkpointing); the loss, every gradient and the updated weights are
torch.equal to the padded step's on packing's grid (the padded rows widened to 128 tokens, the ordered
weight gradients), and to the default (unaligned) padded step's up to the order of the sums over tokens
(measured, bounded); the loss means the same (every algo.loss_agg); packing off keeps the model off the
grid; the layout, the grouping and the validation are checked by hand."""

import copy
import functools

import pytest
import torch

from jetflow.config import ConfigError, derive, load_config
from jetflow.model.attention import align_rows
from jetflow.model.layers import RMSNorm
from jetflow.precision.linear import PrecisionLinear
from jetflow.rl.experience import pack_experience
from jetflow.rl.loss import AGGREGATIONS
from jetflow.run.build import apply_mode, build_policy
from jetflow.run.validate import check_config
from jetflow.train.packing import PackedBatch, micro_batches, pack_rows, use_packing_grid
from jetflow.train.trainer import Trainer

TINY = "configs/tiny.yaml"
LENGTHS = [(4, 40), (7, 3), (2, 70), (9, 12), (5, 20)]  # (prompt, response): 44, 10, 72, 21, 25 tokens


@functools.cache
def model_for(mode: str, numerics: str = "exact"):
    """(model, cfg), built once per mode: callers copy both (`trainer`)."""
    cfg = load_config(TINY, [f"precision.mode={mode}", f"precision.numerics={numerics}", "train.grad_clip=0",
                             "train.lr=1e-2", "train.micro_batch_size=2"])
    torch.manual_seed(0)
    model, _ = build_policy(cfg)
    return apply_mode(model, derive(cfg).precision, "trainer"), cfg


def batch(vocab: int, lengths=LENGTHS):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(1, vocab, (r,), generator=g).tolist() for _, r in lengths]
    advantages = torch.randn(len(lengths), generator=g)
    return pack_experience(prompts, responses, [[0.0] * len(r) for r in responses], torch.ones(len(lengths)),
                           advantages, 0)


def trainer(model, cfg, budget: int, chunk: int = 0, checkpointing: bool = False, grid: bool = False, **train):
    """A Trainer over a copy of model; `grid`: a padded one (budget 0) put on packing's grid as well."""
    c = copy.deepcopy(cfg)
    c.train.max_tokens_per_micro_batch, c.train.logprob_chunk_tokens = budget, chunk
    c.train.activation_checkpointing = checkpointing
    for k, v in train.items():
        setattr(c.train, k, v)
    t = Trainer(copy.deepcopy(model), c.train, c.algo)
    if grid:
        use_packing_grid(t.model)
    return t


def test_pack_rows_is_next_fit_in_batch_order():
    assert pack_rows([5, 3, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]  # 9 > 8: a row of its own
    assert pack_rows([2, 2, 2], 100) == [[0, 1, 2]]
    assert pack_rows([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]  # exactly full
    assert pack_rows([44, 10, 72, 21, 25], 80) == [[0, 1], [2], [3, 4]]


def test_a_packed_row_holds_each_sequence_whole_and_points_at_its_response():
    exp = batch(1000)
    c = load_config(TINY, ["train.max_tokens_per_micro_batch=80"])
    micro = micro_batches(exp, c.train)
    assert [mb.batch_size for mb in micro] == [2, 1, 2] and all(isinstance(mb, PackedBatch) for mb in micro)
    mb = micro[0]
    want = []
    for j in range(2):  # the real tokens of each padded row, one after the other
        want += exp.input_ids[j][exp.attention_mask[j]].tolist()
    assert mb.packed_ids[0].tolist() == want and mb.lengths == [44, 10]
    ids = mb.packed_ids[0]
    assert torch.equal(ids[mb.predict_at + 1], mb.response_ids.reshape(-1)[mb.response_at])  # the next token
    assert mb.predict_at.tolist()[:2] == [3, 4] and mb.predict_at.tolist()[40:] == [44 + 6, 44 + 7, 44 + 8]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_packed_logprobs_equal_the_padded_ones_bit_for_bit(mode):
    model, cfg = model_for(mode)
    exp = batch(model.config.vocab_size)
    real = exp.response_mask.bool()
    padded = trainer(model, cfg, 0).compute_logprobs(exp)
    for budget, chunk in ((256, 16), (30, 0), (1000, 0)):  # 128-token segments: rows of two, of one, of all
        packed = trainer(model, cfg, budget, chunk).compute_logprobs(exp)
        assert torch.equal(packed[real], padded[real]), budget
        assert not packed[~real].any()  # padding: 0, not computed


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def step(model, cfg, exp, budget: int, **kw):
    """(metrics, gradients after the step's backward, the trainer) of one train step."""
    t = trainer(model, cfg, budget, **kw)
    e = copy.copy(exp)
    e.old_logprobs = t.compute_logprobs(e)
    grads = {}
    for n, p in t.model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
    return t.train_step(e), grads, t


# |g_packed - g_padded| / |g_padded| over every parameter, the padded step off the grid (packing off, the
# default), packed on it: measured 4.9e-8 (fp32, 19 of 20 gradients differ), 1.7e-6 (bf16, 14 of 20), 1.3e-2
# (unified, 19 of 20: the FP8 wgrad's 128-token blocks and 128x1 quantization groups held other tokens, so
# other scales too); micro_batch_size 2 -> 3 on the padded path alone moved them by 1e-7, 2e-3 and 1e-2.
# Each bound is at least 4x the gap measured on one machine kind (the padded path's sums are torch's,
# which CPU kinds order differently); a wrong packing shows in the loss, which the test asserts equal.
GRAD_BOUND = {"fp32": 1e-6, "bf16": 1e-5, "unified": 5e-2}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_a_packed_step_equals_the_padded_step_on_packings_grid_and_the_default_one_to_the_sums_order(mode):
    """Rows of the padded micro-batches' sequences ([0, 1], [2, 3], [4] under both: each sequence takes 128
    columns of its row on the grid), chunking and checkpointing on the packed side. Against the padded step on
    the same grid: the loss and entropy metrics, every parameter's gradient and every updated weight are
    torch.equal. Against the default padded step (off the grid, packing off): the loss and entropy are the
    same floats (the same log-probs summed in the same order), the gradients differ within the bound by the
    sums over tokens alone (their order; under unified also the FP8 wgrad's token groups)."""
    model, cfg = model_for(mode)
    exp = batch(model.config.vocab_size)
    padded, g_ref, t_ref = step(model, cfg, exp, 0, grid=True)
    packed, g, t = step(model, cfg, exp, 256, chunk=16, checkpointing=True)
    default, g_default, t_default = step(model, cfg, exp, 0)
    assert [mb.lengths for mb in micro_batches(exp, t.cfg, t.model)] == [[128, 128], [128, 128], [128]]
    for key in ("train/loss", "policy/entropy", "loss/policy", "loss/clip_frac"):
        assert packed[key] == padded[key] == default[key], key
    assert g.keys() == g_ref.keys() and g
    for name, grad in g_ref.items():
        assert torch.equal(g[name], grad), name
    weights, ref = dict(t.model.named_parameters()), dict(t_ref.model.named_parameters())
    assert not torch.equal(ref["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)  # moved
    for name, w in ref.items():
        assert torch.equal(weights[name], w), name
    assert t_default.model.grad_block == 1
    ref = flat(g_default.values())
    gap = float((flat(g.values()) - ref).norm() / ref.norm())
    assert 0 < gap <= GRAD_BOUND[mode], gap


def test_packing_off_keeps_the_model_off_the_grid_and_packing_on_puts_it_on():
    model, cfg = model_for("unified")
    for budget, on in ((0, False), (256, True)):
        m = trainer(model, cfg, budget).model
        assert m.grad_block == (128 if on else 1)
        flags = {x.ordered_wgrad for x in m.modules() if isinstance(x, (PrecisionLinear, RMSNorm))}
        assert flags == {on}
    fast, fast_cfg = model_for("fp32", "fast")
    assert trainer(fast, fast_cfg, 256).model.grad_block == 1  # fast numerics: no exact order to keep


def test_a_packed_row_on_the_grid_pads_each_sequence_with_its_padded_rows_columns():
    model, cfg = model_for("fp32")
    exp = batch(model.config.vocab_size)
    t = trainer(model, cfg, 256)
    mb = micro_batches(exp, t.cfg, t.model)[0]
    assert mb.lengths == [128, 128] and mb.packed_ids.shape == (1, 256)
    shift, _ = align_rows(exp.attention_mask[:2], 128)  # the padded forward's rows widened to 128 (T = 79)
    assert torch.equal(mb.packed_ids[0], exp.input_ids[:2].gather(1, shift).reshape(-1))
    assert mb.real[0].tolist() == [True] * 44 + [False] * 84 + [True] * 10 + [False] * 118
    assert torch.equal(mb.packed_ids[0, mb.predict_at + 1], mb.response_ids.reshape(-1)[mb.response_at])


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_loss_agg_means_the_same_packed(agg):
    """Every aggregation over the same sequences: with the padded micro-batches' grouping the loss is the
    same float; with another grouping (one row for everything) the same value up to the order of the sum."""
    model, cfg = model_for("fp32")
    cfg = copy.deepcopy(cfg)
    cfg.algo.loss_agg = agg
    exp = batch(model.config.vocab_size, LENGTHS[:3])  # 44, 10, 72 tokens (128 columns each): rows [0, 1], [2]
    padded = step(model, cfg, exp, 0)[0]["train/loss"]
    assert step(model, cfg, exp, 256)[0]["train/loss"] == padded
    assert step(model, cfg, exp, 10_000)[0]["train/loss"] == pytest.approx(padded, rel=1e-6, abs=1e-9)


def test_the_sft_step_packs_too():
    model, cfg = model_for("fp32")
    exp = batch(model.config.vocab_size, LENGTHS[:3])
    padded = trainer(model, cfg, 0).sft_step(exp)["loss/sft"]
    assert trainer(model, cfg, 256).sft_step(exp)["loss/sft"] == padded  # the same grouping: the same float


def test_fast_numerics_packed_logprobs_match_closely():
    model, cfg = model_for("fp32", "fast")
    exp = batch(model.config.vocab_size)
    real = exp.response_mask.bool()
    padded = trainer(model, cfg, 0).compute_logprobs(exp)
    packed = trainer(model, cfg, 80).compute_logprobs(exp)
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_packing_is_refused_off_the_native_trainer_by_name(backend):
    with pytest.raises(ConfigError, match=r"^train.max_tokens_per_micro_batch=2048 \(sequence packing\) runs on the "
                                          r"native trainer only; use train.backend=native"):
        check_config(load_config(TINY, [f"train.backend={backend}", "train.max_tokens_per_micro_batch=2048"]))
    with pytest.raises(ConfigError, match=r"^train.max_tokens_per_micro_batch=-1 is out of range; it must be >= 0"):
        check_config(load_config(TINY, ["train.max_tokens_per_micro_batch=-1"]))
    check_config(load_config(TINY, ["train.max_tokens_per_micro_batch=2048"]))
    check_config(load_config(TINY, ["train.max_tokens_per_micro_batch=null"]))


def test_the_memory_estimate_sizes_a_packed_micro_batch_by_its_budget():
    from jetflow.run.memory_estimate import _micro_rows
    assert _micro_rows(load_config(TINY, ["train.max_tokens_per_micro_batch=4096"]), 8, 1088) == 3
    assert _micro_rows(load_config(TINY, ["train.max_tokens_per_micro_batch=512"]), 8, 1088) == 1  # alone
    assert _micro_rows(load_config(TINY, ["train.micro_batch_size=2"]), 8, 1088) == 2


def test_an_moe_models_packed_logprobs_equal_the_padded_ones_with_routing_replay():
    """Qwen3-MoE-style tiny model: the routers (and a replayed routing, moved into the packed columns) see
    the same rows packed and padded."""
    cfg = load_config("configs/tiny-moe.yaml", ["precision.mode=fp32", "precision.numerics=exact"])
    torch.manual_seed(0)
    model, _ = build_policy(cfg)
    model = apply_mode(model, derive(cfg).precision, "trainer")
    exp = batch(model.config.vocab_size, LENGTHS[:3])
    c = model.config
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    g = torch.Generator().manual_seed(2)
    exp.routed_experts = torch.randint(0, c.num_experts, (3, exp.input_ids.shape[1], n_moe, c.num_experts_per_tok),
                                       generator=g)
    real = exp.response_mask.bool()
    padded = trainer(model, cfg, 0).compute_logprobs(exp)
    packed = trainer(model, cfg, 60).compute_logprobs(exp)
    assert torch.equal(packed[real], padded[real])
