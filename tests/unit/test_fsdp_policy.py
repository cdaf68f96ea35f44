"""FSDPPolicy in a world of one process (gloo): after optimizer steps, the FP8 bytes it ships and the
log-probs it computes are those of a plain Decoder holding the same weights (FSDP refills one gathered
buffer in place with its version counter kept, so the linears' per-version caches must be dropped on a
step: without that, the second step would compute with, and ship, the first step's weights); and its frozen
reference policy (algo.kl_coef > 0) keeps FP8 bytes only and computes what the policy did before its update."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from jetflow.config import derive, load_config
from jetflow.model import Decoder, ModelConfig
from jetflow.precision import fp8_linears
from jetflow.rl.experience import pack_experience
from jetflow.run.build import apply_mode, copy_model, load_inputs
from jetflow.run.sides import REFERENCE_FILE, TrainerSide, build_reference
from jetflow.run.validate import check_config
from jetflow.train.reference import reference_nbytes


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


def test_the_fsdp_reference_keeps_fp8_bytes_and_equals_the_policy_until_the_update(tmp_path, world_of_one):
    """The FSDP backend's reference policy (algo.kl_coef > 0): a second FSDPPolicy built from the policy's
    initial weights; under unified each FP8 weight keeps its FP8 bytes only (its fp32 rows freed), the bytes
    the policy's all-gather sends; its log-probs equal the policy's before the first update and stay put
    after it; reference.pt gives the same reference back."""
    from jetflow.train.fsdp import FSDPPolicy
    from jetflow.train.fsdp.gather import FP8ShardWeight

    cfg = load_config("configs/tiny.yaml", [f"run.out_dir={tmp_path}", "precision.mode=unified", "train.backend=fsdp",
                                            "algo.kl_coef=0.05", "run.num_threads=1", "eval.num_prompts=0"])
    side = TrainerSide(cfg, check_config(cfg), load_inputs(cfg))
    trainer = side.trainer
    side.keep_reference(tmp_path)  # what rl_loop does when RL begins
    reference = trainer.reference
    assert isinstance(reference, FSDPPolicy) and reference is not side.model
    assert not any(p.requires_grad for p in reference.parameters())
    fp8 = [p._local_tensor for p in reference.parameters() if isinstance(p._local_tensor, FP8ShardWeight)]
    assert len(fp8) == 7 * side.model.config.num_layers  # q, k, v, o, gate, up, down of every layer
    assert all(w._tensor.untyped_storage().nbytes() == 0 for w in fp8)  # the fp32 rows freed
    policy_fp8 = [p._local_tensor for p in side.model.parameters() if isinstance(p._local_tensor, FP8ShardWeight)]
    weights = sum(w.numel() for w in policy_fp8)
    policy_bytes = reference_nbytes(side.model) - sum(t.nbytes for w in policy_fp8 for t in w.quantized_tensors())
    # the FP8 weights' bytes (1 a weight, one rank: no padding) and scales where the policy keeps 4 bytes a
    # weight; the rest (norms, the embedding, buffers) alike
    assert reference_nbytes(reference) == policy_bytes - 3 * weights + sum(w.quantized_tensors()[1].nbytes for w in fp8)

    problems = side.task.problems(0, 4, 0)
    prompts = [side.encode(p) for p in problems]
    responses = [list(p[-3:]) for p in prompts]  # any tokens: the two policies score the same ones
    zeros = torch.zeros(len(prompts))
    exp = pack_experience(prompts, responses, [[0.0] * len(r) for r in responses], zeros, zeros,
                          side.tokenizer.pad_token_id)
    ref = trainer.compute_logprobs(exp, reference=True)
    # resharded after its lm_head (FSDP would keep a root gathered until a backward, and a reference runs none)
    assert isinstance(reference.decoder.model.embed_tokens.weight, DTensor)
    assert torch.equal(ref, trainer.compute_logprobs(exp))  # the same bytes and forward as the policy's
    exp.old_logprobs, exp.ref_logprobs = trainer.compute_logprobs(exp), ref
    exp.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer.train_step(exp)
    after = trainer.compute_logprobs(exp)
    assert not torch.equal(after, ref)  # the policy moved, the reference did not
    assert torch.equal(trainer.compute_logprobs(exp, reference=True), ref)

    assert (tmp_path / REFERENCE_FILE).is_file()  # a resume: the reference from reference.pt, not the policy
    trainer.reference = build_reference(cfg, side.derived, side.model, tmp_path)
    assert torch.equal(trainer.compute_logprobs(exp, reference=True), ref)


def test_fsdp_layers_do_not_keep_their_gathered_weights_panels_past_their_turn(world_of_one):
    """Under bf16 exact numerics each linear packs its gathered weight into the canonical GEMM's panels. FSDP
    frees a layer's gathered weight at the reshard, but not the panels: without dropping them every layer's
    stayed, the whole model's bf16 panels on every rank (all 3 layers here). After a forward and backward at
    most one layer may hold any."""
    from jetflow.precision.linear import PrecisionLinear
    from jetflow.train.fsdp import FSDPPolicy

    cfg = load_config(None, ["precision.mode=bf16", "precision.numerics=exact"])
    torch.manual_seed(0)
    decoder = Decoder(ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
                                  num_kv_heads=2, head_dim=32, tie_word_embeddings=True))
    policy = FSDPPolicy(apply_mode(decoder, derive(cfg).precision, "trainer"))
    ids = torch.randint(0, 64, (2, 9))
    for _ in range(2):
        policy.lm_head(policy.forward_hidden(ids)).float().logsumexp(-1).mean().backward()
    holding = [i for i, layer in enumerate(policy.decoder.model.layers)
               if any(m.held_tensors() for m in layer.modules() if isinstance(m, PrecisionLinear))]
    assert len(holding) <= 1, holding
