"""The one pre-run pass (jetflow.run.validate): ranges, the correction's typed parameters, the run
directory and the model the run will build, each refused in one line before anything is built."""

import pytest

from jetflow.cli import main
from jetflow.config import ConfigError, load_config
from jetflow.run.validate import check_config, validate_run

TINY = "configs/tiny.yaml"


@pytest.mark.parametrize("override,message", [
    ("train.grad_clip=-1", r"^train.grad_clip=-1.0 is out of range; it must be >= 0"),
    ("train.min_lr_ratio=-1", r"^train.min_lr_ratio=-1.0 is out of range; it must be in \[0, 1\]"),
    ("train.min_lr_ratio=1.5", r"^train.min_lr_ratio=1.5 is out of range"),
    ("train.weight_decay=-0.1", r"^train.weight_decay"),
    ("train.warmup_steps=-2", r"^train.warmup_steps"),
    ("train.betas=[0.9,1.0]", r"^train.betas"),
    ("train.checkpoint_every=-1", r"^train.checkpoint_every"),
    ("train.expert_parallel_size=0", r"^train.expert_parallel_size=0 is out of range; it must be >= 1$"),
    ("train.logprob_chunk_tokens=-1", r"^train.logprob_chunk_tokens=-1 is out of range; it must be >= 0"),
    ("rollout.group_size=1", r"^rollout.group_size=1 is out of range; it must be >= 2: GRPO"),
    ("rollout.group_size=0", r"^rollout.group_size=0 is out of range"),
    ("rollout.top_p=1.5", r"^rollout.top_p=1.5 is out of range; it must be in \(0, 1\]"),
    ("rollout.kv_cache_gib=0", r"^rollout.kv_cache_gib=0.0 is out of range; it must be > 0 GiB, or null"),
    ("algo.kl_coef=-0.1", r"^algo.kl_coef=-0.1 is out of range; it must be >= 0"),
    ("algo.overlong_buffer=-1", r"^algo.overlong_buffer=-1 is out of range; it must be >= 0"),
    ("algo.dynamic_sampling_max_rounds=-1", r"^algo.dynamic_sampling_max_rounds=-1 is out of range"),
    ("algo.clip_low=1.0", r"^algo.clip_low=1.0 is out of range; it must be in \[0, 1\)"),
    ("model.tiny.num_heads=0", r"^model.tiny.num_heads=0 is out of range; it must be >= 1$"),
])
def test_out_of_range_values_are_refused_by_name(override, message):
    """Values that used to run silently as something else (gradient ascent, a negative LR, zero
    advantages, a KL term that never reached the loss) are refused before anything is built."""
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(TINY, [override]))
    check_config(load_config(TINY, ["train.grad_clip=0", "train.min_lr_ratio=0", "rollout.group_size=2"]))  # edges


@pytest.mark.parametrize("key", ["train.logprob_chunk_tokens=1024", "train.activation_checkpointing=true"])
def test_the_native_trainers_memory_savers_are_refused_on_megatron_by_name(key):
    with pytest.raises(ConfigError, match=rf"^{key.split('=')[0]}=.* runs on the native trainer only"):
        check_config(load_config(TINY, ["train.backend=megatron", key]))
    check_config(load_config(TINY, [key]))


@pytest.mark.parametrize("overrides,message", [
    # the config's own docstring once suggested {C: 2.0}: it reached the first RL step as a TypeError
    (["algo.correction=token_tis", "algo.correction_params={C: 2.0}"],
     r"^algo.correction_params: C is not a parameter of token_tis; valid keys: cap \(default 2.0\)$"),
    (["algo.correction=token_mis", "algo.correction_params={cap: 2.0}"],
     r"^algo.correction_params: cap is not a parameter of token_mis; valid keys: lo \(default 0.5\), hi \(default 2.0\)$"),
    (["algo.correction=ais", "algo.correction_params={cap: 2, kl: 1}"],
     r"^algo.correction_params: kl is not a parameter of ais; valid keys: cap .*, kl_scale .*, chi2_scale .*, ess_power"),
    (["algo.correction=none", "algo.correction_params={cap: 2.0}"],
     r"^algo.correction_params: cap is not a parameter of none; valid keys: none, it takes no parameters$"),
    (["algo.correction=seq_tis", "algo.correction_params={cap: -1}"],
     r"^algo.correction_params: cap=-1.0 must be > 0 \(seq_tis\)$"),
    (["algo.correction=seq_mis", "algo.correction_params={lo: 2, hi: 1}"], r"lo=2.0, hi=1.0: need 0 <= lo < hi"),
    (["precision.mode=mixed", "algo.correction_params={C: 2.0}"],  # auto: token_tis under mixed
     r"C is not a parameter of token_tis; .*; algo.correction=auto is token_tis under precision.mode=mixed$"),
])
def test_correction_parameters_are_typed_per_correction(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(TINY, overrides))


def test_valid_correction_parameters_pass():
    for overrides in (["algo.correction=token_tis", "algo.correction_params={cap: 3}"],
                      ["algo.correction=seq_mis", "algo.correction_params={lo: 0.25, hi: 4}"],
                      ["algo.correction=ais", "algo.correction_params={kl_scale: 0.02, ess_power: 0}"],
                      ["precision.mode=mixed", "algo.correction_params={cap: 1.5}"]):
        check_config(load_config(TINY, overrides))


def test_a_bad_correction_parameter_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """`jetflow train` refuses it with exit 2 and one line naming the key and the valid ones: no model is
    built and no run directory is made."""
    import jetflow.run.build as build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the config was checked")
    monkeypatch.setattr(build, "build_policy", no_model)
    monkeypatch.setattr(build, "build_model", no_model)
    rc = main(["train", "--config", TINY, f"run.out_dir={tmp_path}", "algo.correction=token_tis",
               "algo.correction_params={C: 2.0}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("jetflow: error: ConfigError: algo.correction_params: C is not a parameter of token_tis; "
                          "valid keys: cap (default 2.0)")
    assert list(tmp_path.iterdir()) == []


def test_a_response_that_would_pass_the_models_positions_is_refused_before_it_loads(tmp_path):
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "model.tiny.max_position=16", "rollout.max_new_tokens=13"])
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens=13: with prompts of up to 4 tokens, responses "
                                          r"would pass the model's 16 positions; lower it$"):
        validate_run(cfg)


def test_a_kv_budget_too_small_for_one_request_is_refused_before_it_loads(tmp_path):
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "rollout.kv_cache_gib=0.00001"])
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib=1e-05: one request of \d+ tokens needs "):
        validate_run(cfg)
    validate_run(load_config(TINY, [f"run.out_dir={tmp_path}", "rollout.kv_cache_gib=0.01"]))


def test_more_high_precision_layers_than_the_model_has_are_refused_before_it_loads(tmp_path):
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "precision.keep_first_layers=2", "precision.keep_last_layers=1"])
    with pytest.raises(ConfigError, match=r"^precision.keep_first_layers=2 \+ keep_last_layers=1 = 3: the model has 2 "
                                          r"layers; keep at most that many in high precision$"):
        validate_run(cfg)
    assert list(tmp_path.iterdir()) == []
    validate_run(load_config(TINY, [f"run.out_dir={tmp_path}", "precision.keep_first_layers=1",
                                    "precision.keep_last_layers=1"]))


def test_a_run_directory_is_resumed_with_its_own_config_only(tmp_path):
    """A directory that holds a run needs run.resume=true; a resume with another config is refused by
    name unless run.allow_changes lists the key; a damaged config.yaml is refused too."""
    from jetflow.config import config_text
    base = [f"run.out_dir={tmp_path}", "run.name=r"]
    cfg = load_config(TINY, base)
    validate_run(cfg)  # nothing there yet
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_text(cfg))
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"already holds a run; pass run.resume=true"):
        validate_run(cfg)
    validate_run(load_config(TINY, [*base, "run.resume=true", "run.progress=false"]))  # session keys may differ
    with pytest.raises(ConfigError, match=r"started with another config \(train.lr differ from its config.yaml\)"):
        validate_run(load_config(TINY, [*base, "run.resume=true", "train.lr=0.5"]))
    validate_run(load_config(TINY, [*base, "run.resume=true", "train.lr=0.5", "run.allow_changes=[train.lr]"]))
    (run_dir / "config.yaml").write_text("train: [\n")
    with pytest.raises(ConfigError, match=r"config.yaml is damaged"):
        validate_run(load_config(TINY, [*base, "run.resume=true"]))


def test_the_megatron_layout_is_checked_on_the_models_architecture():
    """The checks of jetflow.train.megatron.checks run on the architecture the run will build (here the
    tiny model's), before any weight exists."""
    pytest.importorskip("megatron.core")
    cfg = load_config(TINY, ["train.backend=megatron", "train.tensor_parallel_size=4", "precision.numerics=fast"])
    with pytest.raises(ConfigError, match=r"^train.backend=megatron: num_kv_heads=2 is not a multiple of "
                                          r"tensor_parallel_size=4"):
        validate_run(cfg, processes=4)


@pytest.mark.parametrize("overrides,message", [
    (["algo.ratio_level=sequence", "algo.loss_agg=token_mean"],
     r"^algo.ratio_level=sequence with algo.loss_agg=token_mean: .* set algo.loss_agg=seq_mean_token_mean \(or leave "
     r"it unset: auto\)$"),
    (["algo.overlong_buffer=9"], r"^algo.overlong_buffer=9 exceeds rollout.max_new_tokens=8"),
])
def test_objective_combinations_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(TINY, overrides))
    check_config(load_config(TINY, ["algo.kl_coef=0.05", "algo.kl_estimator=low_var_kl", "algo.kl_in=reward",
                                    "algo.ratio_level=sequence", "algo.loss_agg=seq_mean_token_mean",
                                    "algo.dynamic_sampling=true", "algo.overlong_buffer=4"]))
    check_config(load_config(TINY, ["algo.kl_coef=0.05", "train.backend=megatron"]))  # sharded like the policy
    check_config(load_config(TINY, ["algo.kl_coef=0.05", "train.backend=fsdp"]))  # sharded like the policy
    check_config(load_config(TINY, ["algo.log_ref_kl=true", "run.orchestrator=ray"]))  # kept by the trainer workers


@pytest.mark.parametrize("key", ["rollout.backend=vllm", "train.activation_checkpointing=true"])
def test_the_fsdp_trainer_refuses_what_it_does_not_run_by_name(key):
    with pytest.raises(ConfigError, match=rf"^train.backend=fsdp with {key.split('=')[0]}=.*use {key.split('=')[0]}="):
        check_config(load_config(TINY, ["train.backend=fsdp", key]))


def test_fsdp_refuses_megatron_parallelism():
    with pytest.raises(ConfigError, match=r"^train.tensor_parallel_size=2: model parallelism needs train.backend=megatron"):
        check_config(load_config(TINY, ["train.backend=fsdp", "train.tensor_parallel_size=2"]))


@pytest.mark.parametrize("overrides, processes, message", [
    (["train.backend=fsdp", "train.data_parallel_shard_size=3"], 4,
     r"^train.data_parallel_shard_size=3 must divide the 4 trainer processes"),
    (["train.backend=fsdp", "train.data_parallel_shard_size=4"], 2,
     r"^train.data_parallel_shard_size=4 must divide the 2 trainer processes"),
    (["train.data_parallel_shard_size=2"], 4, r"^train.data_parallel_shard_size=2 sizes the FSDP trainer's shard groups"),
    (["train.backend=fsdp", "train.data_parallel_shard_size=-1"], 4, r"^train.data_parallel_shard_size=-1"),
])
def test_hsdp_shard_sizes_the_world_cannot_hold_are_refused_by_name(tmp_path, overrides, processes, message):
    with pytest.raises(ConfigError, match=message):
        validate_run(load_config(TINY, [f"run.out_dir={tmp_path}", *overrides]), processes=processes)
    validate_run(load_config(TINY, [f"run.out_dir={tmp_path}", "train.backend=fsdp", "train.data_parallel_shard_size=2"]),
                 processes=4)


def test_a_field_the_family_does_not_use_is_one_line_before_the_backend_checks(tmp_path):
    """The recipe checks its own fields before check_blocks asks its family about the backends."""
    for check in (check_config, validate_run):
        with pytest.raises(ConfigError, match="margin=2 does not apply to the mxfp8 family"):
            check(load_config(TINY, [f"run.out_dir={tmp_path}", "precision.family=mxfp8", "precision.margin=2"]))
    with pytest.raises(ConfigError, match="weight_block=\\[32, 32\\] group_size=32 with train.backend=megatron"):
        check_config(load_config(TINY, ["precision.weight_block=[32,32]", "precision.group_size=32",
                                        "train.backend=megatron"]))
