"""vLLM with jetflow's exact plugin (`execution="exact"`, jetflow.rollout.vllm.plugin) on tiny models:
its rollout log-probs equal the trainer's bit for bit (`torch.equal`) in fp32, bf16 and unified, with
and without the FP8 KV cache, also for Qwen3-MoE and Mixtral, on vLLM's paged cache (64-position
blocks holding each mode's bytes: fp32, bf16, E4M3 codes); a request computes the same tokens and
log-probs alone, inside a batch, arriving while others decode, with its prefill chunked and preempted
and recomputed when the blocks run out; greedy log-probs equal the native engine's
(Llama, Llama 3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms), also after in-place updates; updates the
engine cannot take are refused untouched, and models it cannot serve before it starts.

The path of the first test is the mismatch benchmark's (jetflow.bench.mismatch.paired_logprobs with
rollout.backend=vllm): trainer and rollout built as in a run, weights through jetflow.sync. Engines
start in this process (a few seconds each); skipped where vLLM cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jetflow.config import derive, load_config
from jetflow.model import load_hf_dir
from jetflow.precision import QuantRecipe, RecipeMismatchError
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.vllm import UnservedError, VLLMRollout
from jetflow.run.build import apply_mode, attach_kv_fp8, build_policy, build_task, copy_model
from jetflow.run.loop import request_seed
from jetflow.sync import StaleWeightsError, build_update
from test_exact_on_policy import assert_exact, mixed_length_prompts
from vllm_available import vllm_importable  # noqa: F401  (an autouse fixture: skips the module without vLLM)

ROOT = Path(__file__).resolve().parents[2]
CASES = [("fp32", False), ("bf16", False), ("unified", False), ("unified", True)]
KV_BYTES = 64 << 20


def tiny(mode: str, kv_fp8: bool, backend: str = "vllm"):
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), [
        f"precision.mode={mode}", f"precision.kv_cache_fp8={str(kv_fp8).lower()}", "precision.numerics=auto",
        "model.tiny.max_position=600", "rollout.temperature=1.0", f"rollout.backend={backend}", "rollout.max_batch=16"])
    task = build_task(cfg)
    model, tok = build_policy(cfg)
    return cfg, model, tok, task


@pytest.mark.parametrize("mode,kv_fp8", CASES)
def test_vllm_rollout_logprobs_equal_trainer_bit_for_bit(mode, kv_fp8):
    """16 prompts of 3..60 tokens x 512 sampled tokens, continuous batching as vLLM schedules it."""
    cfg, model, tok, task = tiny(mode, kv_fp8)
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), new_tokens=512)


def test_vllm_rollout_logprobs_at_temperature_0_7_equal_trainer():
    """vLLM divides the logits by a per-request temperature tensor before its log_softmax; the trainer
    divides by the float: the same bits (unified, 16 x 64)."""
    cfg, model, tok, task = tiny("unified", False)
    cfg.rollout.temperature = 0.7
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 16, 3, 60), new_tokens=64)


def exact_rollout(model, cfg, tok, tmp_path: Path, **kw) -> VLLMRollout:
    """An exact engine on the rollout side's policy of `model` under cfg's mode, with the trainer's
    update loaded (version 0); the policy is `rollout.policy`."""
    from jetflow.run.vllm_side import write_engine_checkpoint

    policy = apply_mode(copy_model(model), derive(cfg).precision, "rollout")
    attach_kv_fp8(policy, derive(cfg).precision, "rollout")
    path = write_engine_checkpoint(policy, tok, tmp_path, "exact", None)
    kw = {**dict(max_new_tokens=64, temperature=1.0, eos_token_ids=[], max_model_len=160, max_batch=16,
                 kv_cache_bytes=KV_BYTES), **kw}
    rollout = VLLMRollout(path, execution="exact", policy=policy, recipe=cfg.precision.recipe(), **kw)
    trainer = apply_mode(copy_model(model), derive(cfg).precision, "trainer")
    scales = None if not cfg.precision.kv_cache_fp8 else {"k_scale": torch.full((model.config.num_layers,), 0.05),
                                                          "v_scale": torch.full((model.config.num_layers,), 0.05)}
    rollout.load_weights(build_update(trainer, cfg.precision.mode, 0, derive(cfg).precision.fingerprint, kv_scales=scales))
    return rollout


def staggered(rollout: VLLMRollout, prompts, seeds, late: int, after_steps: int):
    """Generate every request but `late`, add `late` after `after_steps` engine steps; (tokens, log-probs)
    per request, by index (vLLM's engine loop, driven by hand)."""
    from vllm.inputs import TokensPrompt

    engine = rollout.llm.llm_engine
    add = lambda i: engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[i]),  # noqa: E731
                                       rollout.sampling_params(seeds[i]))
    for i in range(len(prompts)):
        if i != late:
            add(i)
    done, steps = {}, 0
    while engine.has_unfinished_requests() or late not in done and steps <= after_steps:
        if steps == after_steps:
            add(late)
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[int(out.request_id)] = (list(o.token_ids), [o.logprobs[j][t].logprob for j, t in enumerate(o.token_ids)])
        steps += 1
    return done


def test_a_request_alone_in_a_batch_and_arriving_late_gives_the_same_tokens(tmp_path):
    """unified + FP8 KV, sampled with per-request seeds: request 7 added after 10 engine steps of the
    others decodes beside them as it would alone."""
    cfg, model, tok, _ = tiny("unified", True)
    prompts = mixed_length_prompts(tok, 8, 3, 60, seed=1)
    seeds = [request_seed(cfg.run.seed, 0, i) for i in range(len(prompts))]
    rollout = exact_rollout(model, cfg, tok, tmp_path)
    try:
        batch = rollout.generate(prompts, seeds)
        late = staggered(rollout, prompts, seeds, late=7, after_steps=10)
        for i in (0, 3, 7):
            alone = rollout.generate([prompts[i]], [seeds[i]])
            assert alone.token_ids[0] == batch.token_ids[i] == late[i][0], f"request {i}: tokens differ"
            assert alone.logprobs[0] == batch.logprobs[i] == late[i][1], f"request {i}: log-probs differ"
        assert len(set(map(tuple, batch.token_ids))) == len(prompts)  # the sampling really differs per request
    finally:
        rollout.close()


def test_chunked_prefill_gives_the_native_engines_tokens(tmp_path):
    """Prefills chunked at 24 tokens (max_num_batched_tokens; greedy, since vLLM 0.32 on the CPU cannot
    chunk a seeded request): a 60-token prompt prefilled in three pieces, alone and arriving while
    others decode, gives the tokens and log-probs of the native engine's one-piece prefill."""
    cfg, model, tok, _ = tiny("bf16", False)
    prompts = mixed_length_prompts(tok, 6, 3, 60, seed=3)
    rollout = exact_rollout(model, cfg, tok, tmp_path, temperature=0.0,
                            engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": 24})
    try:
        assert_kv_storage(rollout, model, "bfloat16", 2)  # the bf16 mode's K/V rounding, in its own bytes
        native = native_greedy(rollout.policy, prompts, 64)
        late = staggered(rollout, prompts, list(range(len(prompts))), late=5, after_steps=4)
        alone = rollout.generate([prompts[5]], seeds=[5], greedy=True)
        assert alone.token_ids[0] == late[5][0] == native.token_ids[5]
        assert alone.logprobs[0] == late[5][1] == native.logprobs[5]
        assert [late[i][0] for i in range(len(prompts))] == native.token_ids
        assert [late[i][1] for i in range(len(prompts))] == native.logprobs
    finally:
        rollout.close()


def test_fp8_kv_in_one_byte_blocks_preempted_and_recomputed_gives_the_native_engines_tokens(tmp_path):
    """unified + FP8 KV: vLLM's cache in 64-position blocks of one byte a value (vLLM's own figures), so
    small (8 blocks) that requests wait for blocks and running ones are preempted and recomputed: every
    request's greedy tokens and log-probs equal the native engine's (E4M3 pages) bit for bit."""
    cfg, model, tok, _ = tiny("unified", True)
    prompts = mixed_length_prompts(tok, 8, 3, 60, seed=4)
    c = model.config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 64  # K and V of 64 positions, every layer, 1 byte
    rollout = exact_rollout(model, cfg, tok, tmp_path, temperature=0.0, max_new_tokens=96, kv_cache_bytes=8 * block_bytes)
    try:
        stats = rollout.kv_cache_stats()
        assert stats == {"kv_cache_dtype": "uint8", "kv_block_size": 64, "kv_bytes_per_token": block_bytes // 64,
                         "kv_num_blocks": 8, "kv_pool_bytes": 8 * block_bytes}
        scheduler = rollout.llm.llm_engine.engine_core.engine_core.scheduler
        preempted, preempt = [], scheduler._preempt_request
        scheduler._preempt_request = lambda request, *a, **k: (preempted.append(request.request_id),
                                                                preempt(request, *a, **k))[1]
        out = rollout.generate(prompts, seeds=list(range(len(prompts))), greedy=True)
        assert preempted, "the 8 blocks were enough: nothing was preempted"
        native = native_greedy(rollout.policy, prompts, 96)
        assert out.token_ids == native.token_ids and out.logprobs == native.logprobs
    finally:
        rollout.close()


def assert_kv_storage(rollout: VLLMRollout, model, dtype: str, element_bytes: int) -> None:
    """vLLM's own figures: 64-position blocks of `dtype`, K and V of every layer at `element_bytes` a value."""
    c = model.config
    stats = rollout.kv_cache_stats()
    assert (stats["kv_cache_dtype"], stats["kv_block_size"]) == (dtype, 64)
    assert stats["kv_bytes_per_token"] == 2 * c.num_layers * c.num_kv_heads * c.head_dim * element_bytes


def native_greedy(policy, prompts, new_tokens: int):
    engine = RolloutEngine(policy, [], 0, max_batch=16, max_seq_len=160)
    return engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0), seeds=list(range(len(prompts))))


@pytest.mark.parametrize("mode", ["fp32", "unified"])
def test_greedy_logprobs_equal_the_native_engine_also_after_updates(mode, tmp_path):
    """The same policy in vLLM and in the native engine: the same tokens and log-probs, bit for bit,
    from the first update and after two more (the trainer's FP8 bytes loaded into the PrecisionLinears
    in place); a stale, foreign-recipe, wrong-mode or partial update is refused and changes nothing."""
    cfg, model, tok, _ = tiny(mode, False)
    prompts = mixed_length_prompts(tok, 6, 3, 40, seed=2)
    rollout = exact_rollout(model, cfg, tok, tmp_path, temperature=0.0)
    precision = derive(cfg).precision
    trainer = apply_mode(copy_model(model), precision, "trainer")
    try:
        assert_kv_storage(rollout, model, "float32", 4)
        for version in (1, 2):
            out = rollout.generate(prompts, seeds=list(range(len(prompts))), greedy=True)
            native = native_greedy(rollout.policy, prompts, 64)
            assert out.token_ids == native.token_ids and out.logprobs == native.logprobs
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            rollout.load_weights(build_update(trainer, mode, version, precision.fingerprint, with_checksum=True))
        before = rollout.generate(prompts, seeds=list(range(len(prompts))), greedy=True)
        refused = [(StaleWeightsError, build_update(trainer, mode, 2, precision.fingerprint)),
                   (ValueError, build_update(trainer, "bf16" if mode == "unified" else "unified", 3, precision.fingerprint))]
        if mode == "unified":
            refused.append((RecipeMismatchError, build_update(trainer, mode, 3, QuantRecipe(scale_rule="pow2").fingerprint())))
        partial = build_update(trainer, mode, 3, precision.fingerprint)
        partial.tensors.pop("model.norm.weight")
        refused.append((KeyError, partial))
        for error, update in refused:
            with pytest.raises(error):
                rollout.load_weights(update)
        after = rollout.generate(prompts, seeds=list(range(len(prompts))), greedy=True)
        assert rollout.weight_version == 2 and after.token_ids == before.token_ids and after.logprobs == before.logprobs
    finally:
        rollout.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_architectures_greedy_equal_the_native_engine(family, make_tiny_hf, tmp_path):
    """Llama with Llama 3 RoPE scaling, Qwen2 (q/k/v biases), Qwen3 (q/k norms) in unified: vLLM builds
    its own architecture for each, the plugin computes every op with jetflow's modules."""
    _, hf_dir = make_tiny_hf(family)
    model = load_hf_dir(hf_dir, dtype=torch.float32)
    cfg = load_config(None, ["precision.mode=unified", "precision.numerics=exact"])
    prompts = [[(7 * i + j) % 90 + 5 for j in range(3 + 5 * i)] for i in range(5)]
    rollout = exact_rollout(model, cfg, None, tmp_path, temperature=0.0, max_new_tokens=24)
    try:
        out = rollout.generate(prompts, seeds=list(range(len(prompts))), greedy=True)
        native = native_greedy(rollout.policy, prompts, 24)
        assert out.token_ids == native.token_ids and out.logprobs == native.logprobs
        assert rollout.served["linear"] == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    finally:
        rollout.close()


def test_what_the_plugin_cannot_serve_is_refused_before_the_run_starts(tmp_path):
    """One line naming what cannot be served: a policy not on exact numerics or of a model type the
    plugin was not read against (before vLLM starts), and a layer vLLM builds that the policy has no
    module for (while the engine is built: here a checkpoint with one layer more than the policy)."""
    from jetflow.run.vllm_side import write_engine_checkpoint

    cfg, model, tok, _ = tiny("unified", False)
    fast_cfg = load_config(str(ROOT / "configs/tiny.yaml"), ["precision.numerics=fast"])
    fast = apply_mode(copy_model(model), derive(fast_cfg).precision, "rollout")
    with pytest.raises(UnservedError, match="numerics='fast'"):
        VLLMRollout(tmp_path, execution="exact", policy=fast)
    policy = apply_mode(copy_model(model), derive(cfg).precision, "rollout")
    policy.config.model_type = "gemma"
    with pytest.raises(UnservedError, match="model_type 'gemma'"):
        VLLMRollout(tmp_path, execution="exact", policy=policy)
    policy.config.model_type = "llama"
    deeper = copy_model(model)
    deeper.config.num_layers += 1
    path = write_engine_checkpoint(deeper, tok, tmp_path / "deeper", "exact", None)
    with pytest.raises(Exception, match=r"model\.layers\.2\.self_attn\.qkv_proj has no jetflow module"):
        VLLMRollout(path, execution="exact", policy=policy, max_model_len=64, kv_cache_bytes=KV_BYTES)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_rollout_logprobs_equal_trainer_bit_for_bit(family):
    """Tiny Qwen3-MoE and Mixtral (4 experts, top-2), unified: the router (bf16 under the recipe) and the
    FP8 experts are the policy's SparseMoeBlock, so routing and every expert GEMM are the trainer's."""
    cfg = load_config(str(ROOT / "configs/tiny-moe.yaml"), [
        "precision.mode=unified", f"model.tiny.moe_family={family}", "model.tiny.max_position=200",
        "rollout.backend=vllm", "rollout.max_batch=16"])
    task = build_task(cfg)
    model, tok = build_policy(cfg)
    assert_exact(cfg, model, tok, task, mixed_length_prompts(tok, 8, 3, 30), new_tokens=96)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("mode", ["bf16", "unified"])
def test_smollm2_vllm_rollout_logprobs_equal_trainer_bit_for_bit(smollm2_dir, mode):
    """SmolLM2-135M on countdown, 16 prompts of spread lengths x 96 tokens (results/vllm-exact.md)."""
    from test_exact_on_policy import smollm2_countdown

    cfg, model, tok, task, prompts = smollm2_countdown(smollm2_dir, mode, False)
    cfg.rollout.backend = "vllm"
    assert_exact(cfg, model, tok, task, prompts, new_tokens=96)
