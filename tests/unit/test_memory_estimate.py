"""The memory estimate before a run (jetflow.run.memory_estimate): its terms against sizes computed by
hand for the tiny model and against what the model and autograd really hold, the refusal of a run that
cannot fit (one line, before anything is built), the warning near the limit, and the opt-out."""

import dataclasses

import pytest
import torch
import torch.nn as nn

import jetflow.run.memory_estimate as me
from jetflow.bench.common import saved_activation_bytes
from jetflow.cli import main
from jetflow.config import derive, load_config
from jetflow.model import Decoder
from jetflow.run.build import model_architecture
from jetflow.run.validate import validate_run

TINY = "configs/tiny.yaml"
GIB = 2**30


def tiny(*overrides):
    cfg = load_config(TINY, list(overrides))
    return cfg, derive(cfg), model_architecture(cfg)


MOE, MIXTRAL = ("model.tiny.num_experts=4",), ("model.tiny.num_experts=4", "model.tiny.moe_family=mixtral")
UNTIED = dict(tie_word_embeddings=False)


@pytest.mark.parametrize("overrides,change", [
    ((), {}), ((), UNTIED), ((), dict(model_type="qwen2", qkv_bias=True)),
    ((), dict(qkv_bias=True, o_bias=True, mlp_bias=True, **UNTIED)), ((), dict(model_type="qwen3", qk_norm=True)),
    (MOE, {}), (MOE, UNTIED), (MOE, dict(decoder_sparse_step=2)), (MOE, dict(mlp_only_layers=(0,))),
    (MIXTRAL, {}), (MIXTRAL, UNTIED)])
def test_parameter_count_and_linears_are_the_decoders(overrides, change):
    """ModelConfig.num_parameters and linear_shapes, computed from the architecture alone (the estimate's
    P and the linears whose copies it counts), equal the built Decoder's: dense Llama, tied and untied,
    with biases (Qwen2, Llama's three flags) and q/k norms (Qwen3); Qwen3-MoE with q/k norms, tied and
    untied, with dense layers among the sparse ones; Mixtral, tied and untied."""
    arch = dataclasses.replace(tiny(*overrides)[2], **change)
    model = Decoder(arch)
    assert arch.num_parameters() == model.num_params() == sum(p.numel() for p in model.parameters())
    built = [(n, m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(arch.linear_shapes()) == sorted(built)
    assert arch.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)


def test_terms_of_the_tiny_model_by_hand():
    """configs/tiny.yaml: h=128, L=2, 4 heads / 2 KV heads of 32, i=384, V=19 (tied)."""
    cfg, derived, arch = tiny("precision.mode=fp32", "precision.numerics=exact")
    layer = 128 * 128 * 2 + 64 * 128 * 2 + 3 * 384 * 128 + 2 * 128  # q, o; k, v; the MLP; two norms
    P = 2 * layer + 19 * 128 + 128  # + embedding (the head tied to it) + final norm
    assert P == 396288 == arch.num_parameters()
    est = me.estimate_train_step(cfg, derived, arch, batch=8, prompt_len=20, response_len=44)
    assert est.term("trainer weights") == est.term("gradients") == 4 * P
    assert est.term("AdamW state") == 8 * P
    assert est.term("trainer copies") == 4 * (2 * (layer - 256) + 19 * 128)  # packed fp32 panels of every linear
    per_token = 2 * (32 * 128 + 8 * 64 + 24 * 384) + 16 * 128  # L x (a_h h + a_kv kv + a_i i) + 16 h
    assert est.term("activations") == 8 * 64 * per_token == 8 * 64 * 29696
    assert est.term("backward working set") == 8 * 64 * (32 * 128 + 8 * 64 + 24 * 384)
    assert est.term("logits") == 4 * 256 * 19 * 4  # backward groups of 256 rows > forward 2 x 352 rows x V x 4
    first = me.estimate_train_step(cfg, derived, arch, batch=8, prompt_len=20, response_len=44, first_step_only=True)
    freed = est.term("activations") + est.term("backward working set") + est.term("logits")
    assert first.term("AdamW state") == max(8 * P - freed, 0) == 0  # allocated after the backward freed more
    packed = me.estimate_train_step(tiny("precision.mode=fp32", "precision.numerics=exact",
                                         "train.max_tokens_per_micro_batch=256")[0], derived, arch, 8, 20, 44)
    assert packed.term("activations") == 2 * 128 * per_token  # packing's grid: 64 positions take 128, two a row

    cfg, derived, arch = tiny("precision.mode=unified", "precision.numerics=exact",
                              "train.activation_checkpointing=true", "train.micro_batch_size=4")
    est = me.estimate_train_step(cfg, derived, arch, batch=8, prompt_len=20, response_len=44)
    fp8_layer = 20 * 128 + 8 * 64 + 20 * 384
    assert est.term("activations") == 4 * 64 * (2 * 4 * 128 + fp8_layer + 16 * 128)  # inputs + one layer recomputed
    assert est.term("trainer copies") == 3 * 2 * (layer - 256) + 2 * 19 * 128  # FP8 bytes + panels + transposed; bf16 head


def test_kv_cache_term_is_the_pages_held_or_the_pool():
    """SmolLM2-like pages: 2 x L x kv x 64 positions x 4 B; the held pages, capped by rollout.kv_cache_gib."""
    cfg, derived, arch = tiny("precision.mode=fp32", "train.prompts_per_step=4", "rollout.group_size=8",
                              "eval.num_prompts=0", "rollout.max_new_tokens=100")
    page = 2 * 2 * 64 * 64 * 4  # L=2 layers, kv = 2 heads x 32
    est = me.estimate_run(cfg, derived, arch, prompt_len=10)
    assert est.term("KV cache") == (32 * 2 + 1) * page  # 32 sequences of 110 positions: 2 pages each, + null page
    cfg, derived, arch = tiny("precision.mode=fp32", "train.prompts_per_step=4", "rollout.group_size=8",
                              "eval.num_prompts=0", "rollout.max_new_tokens=100", "precision.kv_cache_fp8=true")
    assert me.estimate_run(cfg, derived, arch, prompt_len=10).term("KV cache") == (32 * 2 + 1) * page // 4
    cfg, derived, arch = tiny("train.prompts_per_step=4", "rollout.group_size=8", "eval.num_prompts=0",
                              "rollout.max_new_tokens=100", "rollout.kv_cache_gib=0.001")
    assert me.estimate_run(cfg, derived, arch, prompt_len=10).term("KV cache") == int(0.001 * GIB)


@pytest.mark.parametrize("mode", ["fp32", "unified"])
def test_activation_term_against_what_autograd_saves(mode):
    """The activation term (coefficients counted once on other shapes) against the bytes autograd saves
    for a micro-batch of another tiny shape, counted by saved-tensor hooks: within 10%."""
    cfg, derived, arch = tiny(f"precision.mode={mode}", "precision.numerics=exact", "model.tiny.hidden_size=192",
                              "model.tiny.num_heads=3", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=512",
                              "model.tiny.num_layers=3")
    from jetflow.run.build import apply_mode
    model = apply_mode(Decoder(arch), derived.precision, "trainer")
    ids = torch.randint(3, 19, (3, 96))  # (B, T)
    saved = saved_activation_bytes(model, lambda: model.forward_hidden(ids, attention_mask=torch.ones_like(ids)))
    expected = 3 * 96 * (me.activation_bytes_per_token(arch, cfg.precision.precision_mode.trainer_kind, False)
                         - me.SAVED_OUTSIDE_LAYERS * arch.hidden_size)  # the head's part is not in forward_hidden
    assert abs(saved - expected) < 0.1 * expected, (saved, expected)


def absurd(tmp_path, *more):
    return load_config(TINY, ["train.prompts_per_step=512", "train.micro_batch_size=4096", "rollout.max_new_tokens=100",
                              f"run.out_dir={tmp_path}", *more])


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(me, "available_memory", lambda device: (8 * GIB, "test"))
    built = []
    monkeypatch.setattr("jetflow.run.sides.build_model", lambda cfg, *a, **k: built.append(cfg))
    with pytest.raises(me.MemoryTooSmall) as e:
        validate_run(absurd(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("memory: this run needs about ")
    assert "the process can have 8.0 GiB" in msg and "train.micro_batch_size (now 4096)" in msg
    assert "run.memory_check=false" in msg
    assert "train.activation_checkpointing" not in msg  # auto tried it (on 2 layers it costs more than it saves)
    with pytest.raises(me.MemoryTooSmall, match=r"set train.activation_checkpointing=true, .*run.memory_check=false"):
        validate_run(absurd(tmp_path, "train.activation_checkpointing=false"))  # an explicit value: named
    assert not built and not any(tmp_path.iterdir())
    # the same through the command line: one line, exit 2, no run directory
    assert main(["train", "--config", TINY, "train.prompts_per_step=512", "train.micro_batch_size=4096",
                 "rollout.max_new_tokens=100", f"run.out_dir={tmp_path}"]) == 2
    assert not any(tmp_path.iterdir())


def test_opt_out_and_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(me, "available_memory", lambda device: (8 * GIB, "test"))
    validate_run(absurd(tmp_path, "run.memory_check=false"))  # skipped: no error
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}"])
    need = me.estimate_run(cfg, derive(cfg), model_architecture(cfg), 10).total
    monkeypatch.setattr(me, "available_memory", lambda device: (int(need * 1.1), "test"))
    validate_run(cfg)
    assert "warning: memory: this run needs about" in capsys.readouterr().err
    monkeypatch.setattr(me, "available_memory", lambda device: (need * 10, "test"))
    validate_run(cfg)
    assert "memory" not in capsys.readouterr().err


def test_available_memory_is_the_lesser_of_meminfo_and_the_cgroup(monkeypatch):
    """MemAvailable 4 GiB; cgroup v2 limit 3 GiB, 1.25 GiB used of which 0.25 GiB inactive page cache: room
    2 GiB; plus this process's 0.5 GiB. Without a limit (v2 'max', v1's 2^63), MemAvailable."""
    files = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:    4194304 kB", "/sys/fs/cgroup/memory.max": str(3 * GIB),
             "/sys/fs/cgroup/memory.current": str(int(1.25 * GIB)),
             "/sys/fs/cgroup/memory.stat": f"anon 1\ninactive_file {GIB // 4}\nactive_file 5",
             "/proc/self/status": "VmRSS:\t 524288 kB"}
    monkeypatch.setattr(me, "_read", files.get)
    assert me.available_memory("cpu") == (int(2.5 * GIB), "the cgroup's memory limit + this process's 0.50 GiB")
    files["/sys/fs/cgroup/memory.max"] = "max"
    assert me.available_memory("cpu")[0] == int(4.5 * GIB)
    v1 = {"/proc/meminfo": files["/proc/meminfo"], "/proc/self/status": files["/proc/self/status"],
          "/sys/fs/cgroup/memory/memory.limit_in_bytes": str(2 * GIB),
          "/sys/fs/cgroup/memory/memory.usage_in_bytes": str(GIB), "/sys/fs/cgroup/memory/memory.stat": "total_inactive_file 0"}
    monkeypatch.setattr(me, "_read", v1.get)
    assert me.available_memory("cpu")[0] == int(1.5 * GIB)
    v1["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "9223372036854771712"
    assert me.available_memory("cpu")[0] == int(4.5 * GIB)


def test_estimate_memory_command_prints_the_terms(capsys):
    assert main(["estimate-memory", "--config", TINY, "precision.mode=fp32"]) == 0
    out = capsys.readouterr().out
    for term in ("trainer weights", "AdamW state", "activations", "logits", "KV cache", "total", "available:"):
        assert term in out
