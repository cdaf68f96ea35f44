"""The memory savers left to `auto` (train.logprob_chunk_tokens, train.activation_checkpointing, the default):
chosen by the memory estimate before the model loads (jetflow.run.memory_estimate.choose_savers), the cheapest
combination that fits with room (neither, chunked log-probs, both), carried in Derived.savers to the trainer and
named in the run's header; an explicit value always wins (then the refusal names what is left), and a run that
fits without savers keeps them off, its numbers unchanged."""

import dataclasses
import json

import pytest

import jetflow.run.memory_estimate as me
from jetflow.cli import main
from jetflow.config import Config, ConfigError, MemorySavers, config_changes, config_text, derive, load_config
from jetflow.run.build import model_architecture
from jetflow.run.validate import check_config, check_run_dir, validate_run

TINY = "configs/tiny.yaml"
PROMPT = 20
OFF, CHUNKS = MemorySavers(), MemorySavers(chunk_tokens=me.AUTO_CHUNK_TOKENS)
BOTH = MemorySavers(checkpointing=True, chunk_tokens=me.AUTO_CHUNK_TOKENS)


def large(*overrides):
    """The tiny config with 8 layers, long responses and a SmolLM2-size vocabulary (the architecture alone:
    the estimate reads no weight), where each saver shrinks the estimate."""
    cfg = load_config(TINY, ["model.tiny.num_layers=8", "rollout.max_new_tokens=512", "train.micro_batch_size=16",
                             *overrides])
    return cfg, derive(cfg), dataclasses.replace(model_architecture(cfg), vocab_size=49152)


def needs(cfg, derived, arch) -> dict[MemorySavers, int]:
    return {o: me.estimate_run(cfg, dataclasses.replace(derived, savers=o), arch, PROMPT).total
            for o in me.saver_options(cfg.train)}


def check_with(monkeypatch, have: float, cfg, derived, arch):
    monkeypatch.setattr(me, "available_memory", lambda device: (int(have), "test"))
    return me.check_memory(cfg, derived, arch, PROMPT).savers


def test_auto_is_the_default_and_a_run_that_fits_resolves_to_off(tmp_path):
    """The tiny config fits many times over: no saver, no header note, the trainer's explicit-off values."""
    assert (Config().train.activation_checkpointing, Config().train.logprob_chunk_tokens) == ("auto", "auto")
    cfg = load_config(TINY, [f"run.out_dir={tmp_path}"])
    assert (cfg.train.activation_checkpointing, cfg.train.logprob_chunk_tokens) == ("auto", "auto")
    assert derive(cfg).savers == OFF  # before the estimate: `auto` off
    derived, _ = validate_run(cfg)
    assert derived.savers == OFF and derived.savers.note == ""
    assert "activation_checkpointing: auto" in config_text(cfg)  # the run's config keeps what the user wrote
    assert load_config(TINY, ["train.activation_checkpointing=true", "train.logprob_chunk_tokens=64"]).train \
        .logprob_chunk_tokens == 64


def test_auto_takes_the_cheapest_savers_that_fit_then_refuses(monkeypatch, capsys):
    cfg, derived, arch = large()
    need = needs(cfg, derived, arch)
    assert list(need) == [OFF, CHUNKS, BOTH] and need[OFF] > need[CHUNKS] > need[BOTH]
    room = me.CHOOSE_FRACTION
    assert check_with(monkeypatch, need[OFF] / room + 1, cfg, derived, arch) == OFF
    chunks = check_with(monkeypatch, need[CHUNKS] / room + 1, cfg, derived, arch)
    assert dataclasses.replace(chunks, note="") == CHUNKS
    assert chunks.note.startswith(f"memory savers (auto): log-prob chunks of {me.AUTO_CHUNK_TOKENS} (estimate ")
    assert f"without: {need[OFF] / me.GIB:.1f} GiB)" in chunks.note
    both = check_with(monkeypatch, need[BOTH] / room + 1, cfg, derived, arch)
    assert dataclasses.replace(both, note="") == BOTH
    assert both.note.startswith("memory savers (auto): activation checkpointing + log-prob chunks of 512 (estimate ")
    assert capsys.readouterr().err == ""  # each fits with room: no warning
    # close to the limit even with both: both, warned; past it: the one-line refusal names what is left
    assert dataclasses.replace(check_with(monkeypatch, need[BOTH] * 1.1, cfg, derived, arch), note="") == BOTH
    assert "warning: memory: " in capsys.readouterr().err
    with pytest.raises(me.MemoryTooSmall) as e:
        check_with(monkeypatch, need[BOTH] * 0.9, cfg, derived, arch)
    msg = str(e.value)
    assert "\n" not in msg and "and activation checkpointing + log-prob chunks of 512 (largest: " in msg
    assert "lower train.micro_batch_size (now 16)" in msg and "train.activation_checkpointing=true" not in msg


@pytest.mark.parametrize("overrides, options", [
    (["train.activation_checkpointing=false"], [OFF, CHUNKS]),
    (["train.logprob_chunk_tokens=0"], [OFF, MemorySavers(checkpointing=True)]),
    (["train.activation_checkpointing=true"], [MemorySavers(checkpointing=True), BOTH]),
    (["train.logprob_chunk_tokens=64", "train.activation_checkpointing=false"], [MemorySavers(chunk_tokens=64)]),
])
def test_an_explicit_value_holds_in_every_option(overrides, options):
    assert me.saver_options(large(*overrides)[0].train) == options


def test_an_explicit_value_wins_even_where_it_does_not_fit(monkeypatch):
    """Where auto fits with both savers, an explicit false keeps checkpointing off, takes the chunks, and is
    refused naming the key; explicit values throughout are the run's, no note."""
    cfg, derived, arch = large()
    need = needs(cfg, derived, arch)
    have = (need[BOTH] + need[CHUNKS]) / 2
    assert dataclasses.replace(check_with(monkeypatch, have, cfg, derived, arch), note="") == BOTH
    off = large("train.activation_checkpointing=false")
    with pytest.raises(me.MemoryTooSmall, match=r"^memory: .* and log-prob chunks of 512 \(largest: .*set "
                                                r"train.activation_checkpointing=true"):
        check_with(monkeypatch, have, *off)
    explicit = large("train.activation_checkpointing=true", "train.logprob_chunk_tokens=128")
    assert check_with(monkeypatch, need[OFF] * 10, *explicit) == MemorySavers(True, 128)


def test_without_the_memory_check_or_an_estimate_auto_is_off(monkeypatch):
    """run.memory_check=false: nothing is estimated, `auto` is off (as before auto existed). Ray, Megatron and
    FSDP runs are not estimated: off too, and their backend checks do not read `auto` as a saver asked for."""
    cfg, derived, arch = large("run.memory_check=false")
    assert check_with(monkeypatch, 1, cfg, derived, arch) == OFF
    for backend in ("fsdp", "megatron"):
        cfg = load_config(TINY, [f"train.backend={backend}"])
        assert check_config(cfg).savers == OFF and check_with(monkeypatch, 1, cfg, derive(cfg), arch) == OFF
    with pytest.raises(ConfigError, match=r"^train.logprob_chunk_tokens=512 runs on the native trainer only"):
        check_config(load_config(TINY, ["train.backend=megatron", "train.logprob_chunk_tokens=512"]))


def test_the_keys_take_auto_or_their_type():
    for bad in ("train.activation_checkpointing=maybe", "train.logprob_chunk_tokens=many",
                "train.logprob_chunk_tokens=true"):
        with pytest.raises(ConfigError, match=rf"^config key '{bad.split('=')[0]}'"):
            load_config(TINY, [bad])
    with pytest.raises(ConfigError, match=r"^train.logprob_chunk_tokens=-1 is out of range; it must be >= 0 .*or auto"):
        check_config(load_config(TINY, ["train.logprob_chunk_tokens=-1"]))


def test_a_run_saved_with_explicit_savers_resumes_under_auto(tmp_path):
    """A run started before `auto` (its config.yaml: false / 0), or under other explicit savers, resumes under
    the defaults: the savers change how a step is computed, not what, and `auto` follows the machine."""
    saved = load_config(TINY, [f"run.out_dir={tmp_path}", "train.activation_checkpointing=false",
                               "train.logprob_chunk_tokens=0"])
    now = load_config(TINY, [f"run.out_dir={tmp_path}", "run.resume=true"])
    assert config_changes(saved, now) == []
    assert config_changes(saved, load_config(TINY, ["train.lr=1e-3"])) == ["train.lr"]  # the rest still compared
    run_dir = tmp_path / "tiny"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config_text(saved))
    check_run_dir(now)


def test_the_header_names_the_choice_and_the_trainer_runs_it_with_the_same_numbers(tmp_path, monkeypatch, capsys):
    """A tiny run whose memory (monkeypatched) fits only with activation checkpointing: the header says what
    auto chose and why, the trainer checkpoints, and its metrics are those of the run with the savers off
    (exact numerics: the same bits)."""
    import jetflow.train.trainer as trainer_module

    quick = ["--no-report", "--config", TINY, "model.tiny.num_layers=4", "train.steps=2", "train.sft_warmup_steps=0",
             "train.prompts_per_step=4", "rollout.group_size=4", "eval.num_prompts=0", "run.progress=false",
             "run.tensorboard=false", "run.num_threads=1", f"run.out_dir={tmp_path}"]
    cfg = load_config(TINY, quick[3:])
    derived, inputs = validate_run(cfg)
    need = {o: me.estimate_run(cfg, dataclasses.replace(derived, savers=o), inputs.arch, inputs.longest_prompt).total
            for o in me.saver_options(cfg.train)}
    ckpt = MemorySavers(checkpointing=True, chunk_tokens=me.AUTO_CHUNK_TOKENS)
    have = int(need[ckpt] / me.CHOOSE_FRACTION) + 1
    assert min(need[OFF], need[CHUNKS]) > me.CHOOSE_FRACTION * have  # only checkpointing fits with room
    monkeypatch.setattr(me, "available_memory", lambda device: (have, "test"))
    checkpointed = []
    enable = trainer_module.enable_activation_checkpointing
    monkeypatch.setattr(trainer_module, "enable_activation_checkpointing",
                        lambda model, *a: checkpointed.append(model) or enable(model, *a))
    assert main(["train", *quick, "run.name=auto"]) == 0
    err = capsys.readouterr().err
    assert "memory savers (auto): activation checkpointing + log-prob chunks of 512 (estimate " in err
    assert checkpointed
    checkpointed.clear()
    assert main(["train", *quick, "run.name=plain", "train.activation_checkpointing=false",
                 "train.logprob_chunk_tokens=0"]) == 0
    assert "memory savers" not in capsys.readouterr().err and not checkpointed

    def metrics(name):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]
    assert metrics("auto") == metrics("plain")


def test_a_train_step_bench_resolves_auto_as_a_run_of_its_step_would(monkeypatch):
    """`jetflow bench train-step` runs the savers a `jetflow train` run whose step is the bench's (batch sequences
    of prompt + response positions, every response at rollout.max_new_tokens) would choose: the same estimate,
    so the same answer as check_memory on that run's config; an explicit value and run.memory_check=false as a
    run takes them."""
    from jetflow.bench.train_step import savers_as_a_run_would

    cfg = load_config(TINY, ["model.tiny.num_layers=8", "train.micro_batch_size=16"])
    arch = dataclasses.replace(model_architecture(cfg), vocab_size=49152)
    run_cfg, run_derived, _ = large("train.prompts_per_step=16", "rollout.group_size=1", "eval.num_prompts=0")
    need = needs(run_cfg, run_derived, arch)  # the run whose step is 16 x (20 + 512)
    monkeypatch.setattr(me, "available_memory", lambda device: (int(need[CHUNKS] / me.CHOOSE_FRACTION) + 1, "test"))
    chosen = savers_as_a_run_would(cfg, arch, 16, PROMPT, 512)
    assert chosen == me.check_memory(run_cfg, run_derived, arch, PROMPT).savers
    assert dataclasses.replace(chosen, note="") == CHUNKS and "log-prob chunks" in chosen.note
    assert savers_as_a_run_would(cfg, arch, 1, PROMPT, 16) == OFF  # a short step fits without
    explicit = load_config(TINY, ["model.tiny.num_layers=8", "train.logprob_chunk_tokens=0",
                                  "train.activation_checkpointing=false"])
    assert savers_as_a_run_would(explicit, arch, 16, PROMPT, 512) == OFF
    unchecked = load_config(TINY, ["model.tiny.num_layers=8", "run.memory_check=false"])
    assert savers_as_a_run_would(unchecked, arch, 16, PROMPT, 512) == OFF
