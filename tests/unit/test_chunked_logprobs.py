"""Chunked log-probs through the lm_head (jetflow.model.chunked_logprobs, train.logprob_chunk_tokens):
under exact numerics the log-probs, entropies, every gradient (the head's and the tied embedding's
included) and the weights a train step updates are torch.equal with chunking off (0) and on at any chunk
size, in fp32, bf16 and unified; the head's own gradient against a float64 reference."""

import copy

import pytest
import torch

from jetflow.config import derive, load_config
from jetflow.model import chunked_logprobs
from jetflow.model.chunked_logprobs import chunked_token_logprobs
from jetflow.rl.experience import pack_experience
from jetflow.run.build import apply_mode, build_policy
from jetflow.train.trainer import Trainer, response_logprobs

TINY = "configs/tiny.yaml"
MODES = ("fp32", "bf16", "unified")
CHUNKS = (5, 16, 17, 32, 1000)
"""Chunk sizes against chunking off (0): 5 (calls of MIN_ROWS = 16 rows), 16 (= the groups below), 17
(not a multiple of them, a last chunk of 5), 32 and 1000 (one chunk)."""


@pytest.fixture(params=[16, chunked_logprobs.GROUP], ids=["group16", "group_default"])
def group(request, monkeypatch):
    """The backward's group size: 16 (the batch's 39 positions in three groups, the last short) and the
    module's own (one group here)."""
    monkeypatch.setattr(chunked_logprobs, "GROUP", request.param)
    return request.param


def exact_model(mode: str):
    """The tiny config's model under `mode` and exact numerics, trainable, as a run's trainer builds it."""
    cfg = load_config(TINY, [f"precision.mode={mode}", "precision.numerics=exact", "train.grad_clip=0",
                             "train.lr=1e-2"])
    torch.manual_seed(0)
    model, _ = build_policy(cfg)
    return apply_mode(model, derive(cfg).precision, "trainer"), cfg


def batch(vocab: int, seed: int = 0):
    """Rows of different prompt and response lengths (left- and right-padding), 3 x up to 13 positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(5, 13), (9, 4), (3, 11)]
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(1, vocab, (r,), generator=g).tolist() for _, r in lengths]
    lps = [[0.0] * len(r) for r in responses]
    return pack_experience(prompts, responses, lps, torch.ones(3), torch.tensor([1.0, -0.5, 0.25]), 0)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_logprobs_and_entropy_equal_one_call_bit_for_bit(mode):
    model, _ = exact_model(mode)
    exp = batch(model.config.vocab_size)
    with torch.no_grad():
        ref_lp, ref_ent = response_logprobs(model, exp, 0.7, with_entropy=True)  # (B, R) each
        for chunk in (1, 5, 17, 1000):  # chunks of 16 rows (the fewest), 17 with a last of 5, and one chunk
            lp, ent = response_logprobs(model, exp, 0.7, with_entropy=True, chunk_tokens=chunk)
            assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent), (mode, chunk)
    lp = response_logprobs(model, exp, 0.7, chunk_tokens=5)  # with the autograd graph
    assert lp.requires_grad and torch.equal(lp.detach(), ref_lp)


def head_weight_name(model) -> str:
    """lm_head.weight, or the embedding's name when the head is tied to it (the tiny model's)."""
    return next(n for n, p in model.named_parameters() if p is model.lm_head.weight)


def _grads(model, exp, chunk: int) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lp = response_logprobs(model, exp, 0.7, chunk_tokens=chunk)  # (B, R)
    (lp * exp.response_mask * exp.advantages[:, None]).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", MODES)
def test_gradients_equal_bit_for_bit_with_chunking_on_and_off(mode, group):
    """Every gradient, the head weight's (tied to the embedding) included: the backward sums the head's
    gradient over fixed groups of positions, whatever the forward's chunk."""
    model, _ = exact_model(mode)
    head = head_weight_name(model)
    exp = batch(model.config.vocab_size)
    ref = _grads(model, exp, 0)
    assert head in ref
    for chunk in CHUNKS:
        got = _grads(model, exp, chunk)
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), (mode, group, chunk, name)


@pytest.mark.parametrize("mode", MODES)
def test_train_step_updates_equal_with_chunking_on_and_off(mode, group):
    """A train step (AdamW, clipping off, 2 micro-batches) with chunking off and on at several chunk
    sizes: the same old log-probs, loss and every updated weight, torch.equal."""
    model, cfg = exact_model(mode)
    exp = batch(model.config.vocab_size)
    results = {}
    for chunk in (0, 5, 17, 64):
        m = copy.deepcopy(model)
        c = copy.deepcopy(cfg)
        c.train.logprob_chunk_tokens, c.train.micro_batch_size = chunk, 2
        trainer = Trainer(m, c.train, c.algo)
        e = copy.copy(exp)
        e.old_logprobs = trainer.compute_logprobs(e)
        metrics = trainer.train_step(e)
        assert metrics["train/skipped"] == 0.0
        results[chunk] = (e.old_logprobs, metrics["train/loss"], dict(m.named_parameters()))
    old0, loss0, w0 = results[0]
    assert any(not torch.equal(w0[n], p) for n, p in model.named_parameters())  # the step moved weights
    for chunk in (5, 17, 64):
        old, loss, w = results[chunk]
        assert torch.equal(old, old0) and loss == loss0, (mode, chunk)
        for name in w0:
            assert torch.equal(w[name], w0[name]), (mode, group, chunk, name)


def test_chunked_head_gradient_against_float64_autograd():
    """An independent reference: a float64 nn.Linear head, plain autograd through log_softmax."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True).double()
    hidden = torch.randn(3, 7, 8, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 7))
    w = torch.randn(3, 7, dtype=torch.float64)
    ref = torch.log_softmax(head(hidden), -1).gather(-1, tokens[..., None])[..., 0]
    gh, gw, gb = torch.autograd.grad((ref * w).sum(), [hidden, head.weight, head.bias])
    got = chunked_token_logprobs(head, hidden, tokens, chunk_tokens=4)  # (3, 7), fp32 out
    ch, cw, cb = torch.autograd.grad((got.double() * w).sum(), [hidden, head.weight, head.bias])
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    for a, b in ((ch, gh), (cw, gw), (cb, gb)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
