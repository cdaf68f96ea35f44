"""Activation checkpointing per decoder layer (train.activation_checkpointing): under exact numerics a
train step's gradients and updated weights are torch.equal with it on and off (fp32, bf16, unified, with
chunked log-probs on and off, and an MoE model with the router loss), the layers really run twice, and the
forward's records survive. The exact attention's blocked backward runs in both."""

import copy

import pytest
import torch
import torch.utils.checkpoint

from jetflow.config import derive, load_config
from jetflow.model.moe import moe_blocks
from jetflow.precision.kv import KVQuantizer, attach_kv_quantizer
from jetflow.rl.experience import pack_experience
from jetflow.run.build import apply_mode, build_policy
from jetflow.train.trainer import Trainer

TINY = "configs/tiny.yaml"


def exact_model(mode: str, extra: tuple[str, ...] = ()):
    cfg = load_config(TINY, [f"precision.mode={mode}", "precision.numerics=exact", "train.grad_clip=0",
                             "train.lr=1e-2", "train.micro_batch_size=2", *extra])
    torch.manual_seed(0)
    model, _ = build_policy(cfg)
    return apply_mode(model, derive(cfg).precision, "trainer"), cfg


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    lengths = [(5, 13), (9, 4), (3, 11)]
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(1, vocab, (r,), generator=g).tolist() for _, r in lengths]
    lps = [[0.0] * len(r) for r in responses]
    return pack_experience(prompts, responses, lps, torch.ones(3), torch.tensor([1.0, -0.5, 0.25]), 0)


def step(model, cfg, exp, checkpointing: bool, chunk: int = 0, kv: KVQuantizer | None = None):
    """(grads after the step's backward, updated weights, metrics, layer-0 forward calls in the step, the
    model)."""
    m, c = copy.deepcopy(model), copy.deepcopy(cfg)
    if kv is not None:
        attach_kv_quantizer(m, kv)
    c.train.activation_checkpointing, c.train.logprob_chunk_tokens = checkpointing, chunk
    trainer = Trainer(m, c.train, c.algo)
    e = copy.copy(exp)
    e.old_logprobs = trainer.compute_logprobs(e)
    calls = []
    m.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))  # recomputation too
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
             for n, p in m.named_parameters()]
    metrics = trainer.train_step(e)
    for h in hooks:
        h.remove()
    return grads, {n: p.detach().clone() for n, p in m.named_parameters()}, metrics, len(calls), m


def assert_same_step(a, b):
    grads_a, weights_a, metrics_a = a[:3]
    grads_b, weights_b, metrics_b = b[:3]
    assert grads_a.keys() == grads_b.keys() and grads_a
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
    for n in weights_a:
        assert torch.equal(weights_a[n], weights_b[n]), n
    assert metrics_a["train/loss"] == metrics_b["train/loss"]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "unified"])
def test_checkpointed_step_equals_the_plain_one_bit_for_bit(mode):
    model, cfg = exact_model(mode)
    exp = batch(model.config.vocab_size)
    off, on = step(model, cfg, exp, False), step(model, cfg, exp, True)
    assert_same_step(off, on)
    assert (off[3], on[3]) == (2, 4)  # 2 micro-batches; recomputed once each in backward


def test_checkpointing_and_chunked_logprobs_together():
    """Checkpointing and chunked log-probs both on against both off: every gradient (the tied head's
    too: the chunked backward's fixed groups) and updated weight torch.equal."""
    model, cfg = exact_model("unified")
    exp = batch(model.config.vocab_size)
    off = step(model, cfg, exp, False)
    assert_same_step(off, step(model, cfg, exp, True, chunk=64))
    assert_same_step(off, step(model, cfg, exp, True, chunk=17))


def test_moe_router_loss_and_records_survive_the_recomputation():
    """An MoE model with the load-balancing loss: the same step; after it each block's records are the
    last micro-batch's first forward's (not its recomputation's), and the FP8 KV quantizer's amax
    calibration is the same as without checkpointing."""
    model, cfg = exact_model("unified", ("model.tiny.num_experts=4", "algo.router_aux_loss_coef=0.01"))
    exp = batch(model.config.vocab_size)
    seen = {}
    for block in moe_blocks(model):  # each forward's router logits, in call order (deepcopy keeps hooks)
        block.register_forward_hook(lambda b, args, out: seen.setdefault(id(b), []).append(b.last_router_logits))
    results, amax = {}, {}
    for flag in (False, True):
        seen.clear()
        kv = KVQuantizer(model.config.num_layers, apply=False)
        kv.calibrating = True
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole layers: hooks fire
            results[flag] = step(model, cfg, exp, flag, kv=kv)
        amax[flag] = (kv.k_amax, kv.v_amax)
        blocks = moe_blocks(results[flag][4])
        for b in blocks:
            calls = seen[id(b)]  # log-probs of mb 1, 2, then the step's mb 1 (its recomputation), mb 2 (...)
            assert len(calls) == (6 if flag else 4) and b.last_router_logits is calls[-2 if flag else -1]
    assert_same_step(results[False], results[True])
    assert "loss/router_aux" in results[True][2]
    assert all(torch.equal(a, b) for a, b in zip(amax[False], amax[True])) and bool(amax[True][0].gt(0).all())
