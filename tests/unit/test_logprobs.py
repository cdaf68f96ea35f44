"""The one log-prob function both sides call, and its entropy twin."""

import torch

from jetflow.model.logprobs import token_logprobs, token_logprobs_and_entropy


def test_logprobs_rows_do_not_depend_on_the_batch_and_entropy_matches_fp64():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 1000, generator=gen) * 3
    tokens = torch.randint(0, 1000, (6, 5), generator=gen)
    full = token_logprobs(logits, tokens, 0.7)  # (6, 5)
    # a decode step's (B, V) rows, one position at a time, give the same bits as the trainer's (B, R, V)
    for t in range(5):
        assert torch.equal(token_logprobs(logits[:, t], tokens[:, t], 0.7), full[:, t])
    assert torch.equal(token_logprobs(logits[2:3, 4], tokens[2:3, 4], 0.7), full[2:3, 4])
    logp, entropy = token_logprobs_and_entropy(logits, tokens, 0.7)
    assert torch.equal(logp, full)
    p = torch.softmax(logits.double() / 0.7, -1)
    torch.testing.assert_close(entropy.double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)
