"""Sequence packing (train.max_tokens_per_micro_batch, jetflow.train.packing), against the padded path as
the reference: under exact numerics the log-probs and entropies are torch.equal (fp32, bf16, unified, with
chunked log-probs and activation checkpointing), the loss means the same (every algo.loss_agg), and the
gradients agree to the bound the module docstring states (they are sums over tokens, whose rounding
order packing changes); the layout, the grouping and the validation are checked by hand."""

import copy
import functools

import pytest
import torch

from jetflow.config import ConfigError, derive, load_config
from jetflow.rl.experience import pack_experience
from jetflow.rl.loss import AGGREGATIONS
from jetflow.run.build import apply_mode, build_policy
from jetflow.run.validate import check_config
from jetflow.train.packing import PackedBatch, micro_batches, pack_rows
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


def trainer(model, cfg, budget: int, chunk: int = 0, checkpointing: bool = False, **train):
    c = copy.deepcopy(cfg)
    c.train.max_tokens_per_micro_batch, c.train.logprob_chunk_tokens = budget, chunk
    c.train.activation_checkpointing = checkpointing
    for k, v in train.items():
        setattr(c.train, k, v)
    return Trainer(copy.deepcopy(model), c.train, c.algo)


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
    for budget, chunk in ((80, 16), (30, 0), (1000, 0)):  # three rows, one per sequence, one for all
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


# |g_packed - g_padded| / |g_padded| over every parameter, measured 4e-8 (fp32), 6e-10 (bf16), 4e-3 (unified:
# the FP8 wgrad's 128-token quantization groups held padding tokens); micro_batch_size 2 -> 3 on the padded
# path alone moves them by 1e-7, 2e-3 and 1e-2
GRAD_BOUND = {"fp32": 1e-6, "bf16": 1e-5, "unified": 2e-2}


@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_a_packed_step_has_the_padded_loss_and_entropy_and_gradients_to_the_bound(mode):
    """Rows of the padded micro-batches' sequences ([0, 1], [2, 3], [4] under both): the loss and entropy
    metrics are equal; the gradients, with chunking and checkpointing on the packed side, within the bound."""
    model, cfg = model_for(mode)
    exp = batch(model.config.vocab_size)
    padded, g_ref, _ = step(model, cfg, exp, 0)
    packed, g, t = step(model, cfg, exp, 100, chunk=16, checkpointing=True)
    assert len(micro_batches(exp, t.cfg)) == 3
    for key in ("train/loss", "policy/entropy", "loss/policy", "loss/clip_frac"):
        assert packed[key] == padded[key], key
    assert g.keys() == g_ref.keys() and g
    ref = flat(g_ref.values())
    assert float((flat(g.values()) - ref).norm() / ref.norm()) <= GRAD_BOUND[mode]


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_loss_agg_means_the_same_packed(agg):
    """Every aggregation over the same sequences: with the padded micro-batches' grouping the loss is the
    same float; with another grouping (one row for everything) the same value up to the order of the sum."""
    model, cfg = model_for("fp32")
    cfg = copy.deepcopy(cfg)
    cfg.algo.loss_agg = agg
    exp = batch(model.config.vocab_size, LENGTHS[:3])  # 44, 10, 72 tokens: rows [0, 1], [2] as padded
    padded = step(model, cfg, exp, 0)[0]["train/loss"]
    assert step(model, cfg, exp, 60)[0]["train/loss"] == padded
    assert step(model, cfg, exp, 10_000)[0]["train/loss"] == pytest.approx(padded, rel=1e-6, abs=1e-9)


def test_the_sft_step_packs_too():
    model, cfg = model_for("fp32")
    exp = batch(model.config.vocab_size, LENGTHS[:3])
    padded = trainer(model, cfg, 0).sft_step(exp)["loss/sft"]
    assert trainer(model, cfg, 60).sft_step(exp)["loss/sft"] == padded  # the same grouping: the same float


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
