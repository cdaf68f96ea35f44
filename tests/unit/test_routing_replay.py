"""Routing replay: the rollout engine records each MoE layer's expert choice at every position it ran,
pack_experience places them at the tokens' columns, and the trainer's forward routes by them.

References: the rollout's choices are checked against a full forward of the same tokens (exact
numerics: one computation, so equal), and the replayed trainer forward against the rollout's record
(the experts used are the recorded ones, torch.equal) and against a hand count of the flips.
"""

import pytest
import torch

from jetflow.model.decoder import Decoder, ModelConfig
from jetflow.model.moe import moe_blocks, replay_flip_fraction
from jetflow.precision import apply_precision
from jetflow.rl.experience import pack_experience
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.train.trainer import response_logprobs

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(1,))
MOE_LAYERS = [0, 2]
PROMPTS = [[3, 9, 4, 17, 5], [8, 1], [30, 31, 32, 33, 34, 35, 36]]  # different lengths


def tiny(seed: int = 0, exact: bool = True) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(CFG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    if exact:
        apply_precision(model, "fp32", numerics="exact")
        model.numerics = "exact"
    return model


def rollout(model: Decoder, record: bool = True):
    engine = RolloutEngine(model, eos_token_ids=[0], pad_token_id=63, max_batch=2, max_seq_len=32,
                           record_routing=record)
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=7, temperature=1.0), seeds=[1, 2, 3])


def full_forward_routing(model: Decoder, tokens: list[int]) -> torch.Tensor:
    """(T, L_moe, K): the routers' choices in one uncached forward over `tokens`."""
    with torch.no_grad():
        model.forward_hidden(torch.tensor([tokens]))
    return torch.stack([b.last_topk_ids for b in moe_blocks(model)], dim=1)


def test_engine_records_every_position_it_ran():
    model = tiny()
    out = rollout(model)
    assert out.routed_experts is not None and rollout(model, record=False).routed_experts is None
    for prompt, tokens, ids in zip(out.prompt_ids, out.token_ids, out.routed_experts):
        n = len(prompt) + len(tokens) - 1  # the last sampled token is never fed back
        assert ids.shape == (n, len(MOE_LAYERS), 2) and ids.dtype == torch.int16
        # exact numerics: prefill + cached decode route like one full forward, bit for bit
        assert torch.equal(ids.long(), full_forward_routing(model, (prompt + tokens)[:n]))


def test_engine_refuses_dense_models_and_compile():
    dense = Decoder(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                                num_kv_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        RolloutEngine(dense, eos_token_ids=[0], pad_token_id=0, max_batch=1, max_seq_len=8, record_routing=True)
    with pytest.raises(ValueError, match="compile"):
        RolloutEngine(tiny(exact=False), eos_token_ids=[0], pad_token_id=0, max_batch=1, max_seq_len=8,
                      record_routing=True, compile=True)


def test_pack_places_ids_at_the_token_columns():
    prompts, responses = [[5, 6], [7, 8, 9]], [[1, 2, 3], [4]]
    routing = [torch.arange(4 * 2 * 2).view(4, 2, 2), torch.full((3, 2, 2), 9)]  # n = prompt + response - 1
    exp = pack_experience(prompts, responses, [[0.0] * 3, [0.0]], torch.zeros(2), torch.zeros(2), pad_id=0,
                          routed_experts=routing)
    assert exp.routed_experts.shape == (2, 3 + 3, 2, 2)  # P = 3, R = 3
    want0 = torch.full((6, 2, 2), -1)
    want0[1:5] = routing[0]  # left padding of one column
    want1 = torch.full((6, 2, 2), -1)
    want1[0:3] = 9
    assert torch.equal(exp.routed_experts[0], want0) and torch.equal(exp.routed_experts[1], want1)
    assert torch.equal(exp.select(slice(1, 2)).routed_experts, exp.routed_experts[1:2])
    with pytest.raises(ValueError, match="does not fit"):
        pack_experience(prompts, responses, [[0.0] * 3, [0.0]], torch.zeros(2), torch.zeros(2), pad_id=0,
                        routed_experts=[torch.zeros(6, 2, 2), routing[1]])


def experience(out):
    n = len(out.prompt_ids)
    return pack_experience(out.prompt_ids, out.token_ids, out.logprobs, torch.zeros(n), torch.zeros(n), pad_id=63,
                           routed_experts=out.routed_experts)


@torch.no_grad()
def test_replay_on_the_same_policy_changes_nothing():
    """Exact numerics: the trainer's own routing is the rollout's, so replaying it gives the same bits."""
    model = tiny()
    exp = experience(rollout(model))
    replayed = response_logprobs(model, exp)
    assert replay_flip_fraction(model) == 0.0
    exp.routed_experts = None
    assert torch.equal(response_logprobs(model, exp), replayed)
    assert replay_flip_fraction(model) is None


@torch.no_grad()
@pytest.mark.parametrize("exact", [True, False])
def test_replay_routes_by_the_rollouts_choice(exact):
    """A rollout policy whose routers differ from the trainer's: under replay the trainer's experts are
    the rollout's at every position the rollout ran, and the flip fraction is the hand count of
    tokens whose router, on its input in that forward, ranks other experts top."""
    rollout_model, trainer = tiny(seed=1, exact=exact), tiny(seed=0, exact=exact)
    for src, dst in zip(moe_blocks(rollout_model), moe_blocks(trainer)):  # same weights but the routers
        dst.experts.load_state_dict(src.experts.state_dict())
    exp = experience(rollout(rollout_model))
    own = response_logprobs(trainer, exp.__class__(**{**exp.__dict__, "routed_experts": None}))
    replayed = response_logprobs(trainer, exp)
    # what each router would have chosen on its input in the replayed forward (later layers' inputs
    # follow the earlier layers' replayed experts): (B * T, K) each, in the order the layers saw the rows
    own_ids = [torch.softmax(b.last_router_logits.float(), -1).topk(2, -1).indices for b in moe_blocks(trainer)]
    assert not torch.equal(own, replayed)
    B, T = exp.input_ids.shape
    flips = total = 0
    for j, block in enumerate(moe_blocks(trainer)):
        want = exp.routed_experts[:, :, j].reshape(B * T, 2)  # -1 rows: the router's own choice
        ran = want[:, 0] >= 0
        got = block.last_topk_ids
        if exact:  # the layers saw the rows realigned (padding first moved to the end): undo it
            got = realigned_back(got.view(B, T, 2), exp.attention_mask).reshape(B * T, 2)
            mine = realigned_back(own_ids[j].view(B, T, 2), exp.attention_mask).reshape(B * T, 2)
        else:
            mine = own_ids[j]
        assert torch.equal(got[ran], want[ran])
        flips += int((mine[ran].sort(-1).values != want[ran].sort(-1).values).any(-1).sum())
        total += int(ran.sum())
    assert flips > 0
    assert replay_flip_fraction(trainer) == flips / total


def realigned_back(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values (B, T, ...) in exact numerics' aligned order -> the batch's column order."""
    T = mask.shape[1]
    start = mask.long().argmax(-1)  # (B,)
    back = (torch.arange(T)[None] - start[:, None]) % T  # (B, T)
    return x.gather(1, back.view(*back.shape, *[1] * (x.dim() - 2)).expand_as(x))


def test_routed_ids_rows_are_all_or_nothing():
    block = moe_blocks(tiny(exact=False))[0]
    x = torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="all -1"):
        block(x.view(1, 2 * 16, 32)[:, :1], routed_ids=torch.tensor([[[-1, 2]]]))
