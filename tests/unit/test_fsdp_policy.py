"""FSDPPolicy in a world of one process (gloo): after optimizer steps, the FP8 bytes it ships and the
log-probs it computes are those of a plain Decoder holding the same weights (FSDP refills one gathered
buffer in place with its version counter kept, so the linears' per-version caches must be dropped on a
step: without that, the second step would compute with, and ship, the first step's weights)."""

import pytest
import torch
import torch.distributed as dist

from jetflow.config import derive, load_config
from jetflow.model import Decoder, ModelConfig
from jetflow.precision import fp8_linears
from jetflow.run.build import apply_mode, copy_model


@pytest.fixture
def world_of_one():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fsdp_policy_ships_and_computes_with_the_current_weights_after_each_step(world_of_one):
    from jetflow.train.fsdp import FSDPPolicy

    cfg = load_config(None, ["precision.mode=unified", "precision.gemm_backend=emulate"])
    torch.manual_seed(0)
    decoder = Decoder(ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=32, tie_word_embeddings=True))
    precision = derive(cfg).precision
    policy = FSDPPolicy(apply_mode(decoder, precision, "trainer"))
    assert (policy.kind, policy.recipe) == ("fp8", precision.recipe)  # what export asks a ShardedPolicy
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 9))
    for _ in range(3):
        policy.lm_head(policy.forward_hidden(ids)).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        shipped = policy.quantized_weights()  # before anything else allocates: FSDP's buffers at their old addresses
        with torch.no_grad():
            logits = policy.lm_head(policy.forward_hidden(ids))
        # a plain Decoder with the gathered weights, under the same mode
        reference = apply_mode(copy_model(policy), precision, "trainer")
        assert shipped and set(shipped) == set(fp8_linears(reference))
        for name, layer in fp8_linears(reference).items():
            expected = layer.quantized_weight()
            assert torch.equal(shipped[name].data.view(torch.uint8), expected.data.view(torch.uint8)), name
            assert torch.equal(shipped[name].scale_inv, expected.scale_inv), name
        with torch.no_grad():
            assert torch.equal(logits, reference(ids))
