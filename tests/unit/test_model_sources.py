"""Models in and out: `jetflow generate` and `jetflow.model.load` take a Hugging Face directory, an FP8
export (run with its exported bytes), a run checkpoint or a run directory; `write_final_model` leaves a
run's policy as <run>/model (HF, bf16) and <run>/model-fp8 (its FP8 export)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import jetflow.precision.fp8_function as precision_fp8
from jetflow.cli import main
from jetflow.export import FINAL_FP8_DIR, FINAL_MODEL_DIR, export_fp8, write_final_model
from jetflow.model import CheckpointError, save_hf_dir
from jetflow.run.sources import load_model, load_model_tokenizer, resolve_model_dir
from jetflow.precision import QuantRecipe, apply_precision, fp8_linears
from jetflow.rollout.engine import RolloutEngine, SamplingParams
from jetflow.train.checkpoint import MANIFEST, latest_checkpoint, save_checkpoint

PROMPTS = ["3+4=", "9+1="]
IDS = torch.tensor([[5, 6, 13, 7, 15, 9], [12, 4, 13, 3, 15, 8]])  # characters of the tiny alphabet


# ---- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished tiny unified run (SFT warm-up, 2 RL steps): checkpoints step_000000 and step_000002."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", "--no-report", "--config", "configs/tiny.yaml", "train.steps=2", "train.sft_warmup_steps=5",
                 f"run.out_dir={out}", "run.name=r", "run.progress=false", "run.tensorboard=false"]) == 0
    return out / "r"


@pytest.fixture(scope="module")
def hf_dir(run_dir, tmp_path_factory):
    """The run's policy as an HF directory with every weight on the bf16 grid, so that its FP8 export
    (bf16 for what stays in high precision) loses nothing but the FP8 rounding."""
    model = load_model(run_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return save_hf_dir(model, tmp_path_factory.mktemp("hf") / "m", tokenizer_dir=load_model_tokenizer(run_dir))


@pytest.fixture(scope="module")
def export_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "fp8"
    assert main(["export", "--model", str(hf_dir), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def odd_export(export_dir, tmp_path_factory):
    """An export with a block that is not what quantizing its values gives (data halved, scale doubled:
    the same values): a loader that requantized the dequantized weights would run other bytes."""
    from safetensors.torch import save_file

    from jetflow.precision import quantize_weight

    odd = shutil.copytree(export_dir, tmp_path_factory.mktemp("odd") / "fp8")
    tensors = load_file(odd / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    tensors[f"{name}.weight"] = (tensors[f"{name}.weight"].float() / 2).to(torch.float8_e4m3fn)
    tensors[f"{name}.weight_scale_inv"] = tensors[f"{name}.weight_scale_inv"] * 2
    save_file(tensors, str(odd / "model.safetensors"), metadata={"format": "pt"})
    requantized = quantize_weight(load_model(odd, precision="bf16").get_submodule(name).weight.detach())
    assert not torch.equal(requantized.data.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
    return odd


def older_run(run_dir, tmp_path):
    """A copy of the run as runs were before final models and self-describing checkpoints: no model/,
    checkpoints without config.json or tokenizer (their model comes from the run's config.yaml)."""
    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy)
    for d in (FINAL_MODEL_DIR, FINAL_FP8_DIR):
        shutil.rmtree(copy / d, ignore_errors=True)
    for ckpt in (copy / "checkpoints").glob("step_*"):
        digests = json.loads((ckpt / MANIFEST).read_text())
        for name in ("config.json", "char_tokenizer.json"):
            (ckpt / name).unlink(missing_ok=True)
            digests.pop(name, None)
        (ckpt / MANIFEST).write_text(json.dumps(digests))
    return copy


def greedy(model, tokenizer, prompts=PROMPTS, max_new_tokens=6) -> list[str]:
    ids = [tokenizer.encode(p) for p in prompts]
    engine = RolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_batch=len(ids),
                           max_seq_len=max(map(len, ids)) + max_new_tokens, tokenizer=tokenizer)
    return engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)).texts


def cli_generate(model_dir, capsys, *extra: str) -> list[str]:
    """The completions `jetflow generate` prints."""
    capsys.readouterr()
    assert main(["generate", "--model", str(model_dir), *PROMPTS, "--max-new-tokens", "6", *extra]) == 0
    out = capsys.readouterr().out
    return re.findall(r"=== \[\d+\] [^\n]*\n(.*?)\n--- \(\d+ tokens", out, flags=re.DOTALL)


@pytest.fixture
def fp8_gemm_weights(monkeypatch):
    """Every weight operand (QuantizedTensor) the FP8 GEMMs of a forward receive."""
    seen = []
    real = precision_fp8.fp8_matmul

    def spy(a, b, *args, **kwargs):
        seen.append(b)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(precision_fp8, "fp8_matmul", spy)
    return seen


def assert_exported_bytes(weights, export_dir, expected_modules: int):
    """Each weight a GEMM received is, bit for bit, one of the exported weights with its scales."""
    stored = load_file(export_dir / "model.safetensors")
    fp8 = {k[: -len(".weight_scale_inv")]: (stored[k[: -len("_scale_inv")]], v)
           for k, v in stored.items() if k.endswith(".weight_scale_inv")}
    assert len(fp8) == expected_modules
    used = set()
    for q in weights:
        match = [m for m, (data, scale) in fp8.items() if data.shape == q.data.shape
                 and torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(scale, q.scale_inv)]
        assert match, f"a GEMM ran weight bytes {tuple(q.data.shape)} that are not in the export"
        used.update(match)
    assert used == set(fp8)  # and every exported weight was used


def assert_same_safetensors(a, b):
    """The same tensors (names, dtypes, shapes, bytes) and metadata. (Not the same file bytes: safetensors
    writes the metadata's keys in a hash map's order.)"""
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        assert fa.metadata() == fb.metadata()
        assert sorted(fa.keys()) == sorted(fb.keys())
        for name in fa.keys():
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name


# ---- FP8 exports ---------------------------------------------------------------------------------


@torch.no_grad()
def test_an_export_loads_running_its_exported_bytes(hf_dir, export_dir, fp8_gemm_weights):
    """Before, loading an export failed on `unexpected tensors ... weight_scale_inv`."""
    assert resolve_model_dir(export_dir).kind == "fp8-export"
    model = load_model(export_dir)
    layers = fp8_linears(model)
    assert len(layers) == 14  # q k v o gate up down x 2 layers; lm_head (tied embedding) stays bf16
    logits = model(IDS)
    assert len(fp8_gemm_weights) == 14
    assert_exported_bytes(fp8_gemm_weights, export_dir, 14)

    # the trainer's forward under the same recipe: the same bytes, so the same logits bit for bit
    trainer = apply_precision(load_model(hf_dir), "fp8", QuantRecipe())
    assert torch.equal(trainer(IDS), logits)
    assert not torch.equal(load_model(hf_dir)(IDS), logits)  # (FP8 took effect)
    # asked for fp8 under its own recipe, it keeps the bytes; another precision runs the dequantized weights
    assert torch.equal(load_model(export_dir, precision="fp8")(IDS), logits)
    bf16 = load_model(export_dir, precision="bf16")
    assert not fp8_linears(bf16) and (bf16(IDS) - logits).abs().max() < 0.1 * logits.abs().max()


@torch.no_grad()
def test_bytes_are_used_as_stored_even_where_requantizing_would_change_them(odd_export, fp8_gemm_weights):
    load_model(odd_export)(IDS)
    assert_exported_bytes(fp8_gemm_weights, odd_export, 14)


def test_a_damaged_export_is_one_clear_error(export_dir, tmp_path):
    from safetensors.torch import save_file

    bad = shutil.copytree(export_dir, tmp_path / "noscale")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj.weight is float8 but has no weight_scale_inv"):
        load_model(bad)

    other = shutil.copytree(export_dir, tmp_path / "awq")
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: quantization_config .*awq.* is not block FP8"):
        load_model(other)

    relabeled = shutil.copytree(export_dir, tmp_path / "relabeled")  # a recipe that keeps layer 0 in bf16
    config = json.loads((relabeled / "config.json").read_text())
    recipe = QuantRecipe(keep_first_layers=1)
    config["quantization_config"] = recipe.vllm_quantization_config()
    (relabeled / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"does not fit its recipe .*FP8 weights are stored for "
                                              r"\['model.layers.0"):
        load_model(relabeled)


def test_export_load_export_reproduces_the_files(export_dir, tmp_path):
    recipe = QuantRecipe()
    assert main(["export", "--model", str(export_dir), "--out", str(tmp_path / "cli")]) == 0
    export_fp8(load_model(export_dir), tmp_path / "api", recipe, tokenizer_dir=export_dir)
    for again in (tmp_path / "cli", tmp_path / "api"):
        for name in ("config.json", "char_tokenizer.json"):
            assert (again / name).read_bytes() == (export_dir / name).read_bytes(), (again, name)
        assert_same_safetensors(again / "model.safetensors", export_dir / "model.safetensors")
    # under another recipe the export requantizes (and says so in its config), it does not relabel the bytes
    pow2 = QuantRecipe(scale_rule="pow2")
    other = load_file(export_fp8(load_model(export_dir), tmp_path / "pow2", pow2) / "model.safetensors")
    scales = other["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two now
    qc = json.loads((tmp_path / "pow2" / "config.json").read_text())["quantization_config"]
    assert qc["jetflow_fingerprint"] == pow2.fingerprint()


def test_generate_from_an_export_runs_fp8_with_the_exported_bytes(hf_dir, export_dir, odd_export, capsys,
                                                                  fp8_gemm_weights):
    texts = cli_generate(export_dir, capsys)
    assert_exported_bytes(fp8_gemm_weights, export_dir, 14)  # the default precision of an export: its FP8
    trainer = apply_precision(load_model(hf_dir), "fp8", QuantRecipe())
    assert texts == greedy(trainer, load_model_tokenizer(hf_dir)) and len(texts) == 2
    assert cli_generate(export_dir, capsys, "--precision", "fp8") == texts
    fp8_gemm_weights.clear()
    cli_generate(odd_export, capsys)
    assert_exported_bytes(fp8_gemm_weights, odd_export, 14)  # as stored, not requantized

    assert main(["generate", "--model", str(export_dir), "x", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "is an FP8 export" in err and len(err.strip().splitlines()) == 1


# ---- run checkpoints and run directories --------------------------------------------------------


@torch.no_grad()
def test_generate_from_a_run_and_from_its_checkpoint(run_dir, tmp_path, capsys):
    """A run written before final models: the run resolves to its newest checkpoint, whose model and
    tokenizer are described by the run's config.yaml."""
    run = older_run(run_dir, tmp_path)
    newest = run / "checkpoints" / "step_000002"
    assert latest_checkpoint(run) == newest and not (newest / "config.json").exists()
    source = resolve_model_dir(run)
    assert (source.kind, source.weights_dir, source.run_dir) == ("checkpoint", newest, run.resolve())

    model = load_model(run)
    stored = load_file(newest / "model.safetensors")
    assert set(stored) == set(model.state_dict()) - {"lm_head.weight"}  # tied
    for name, t in stored.items():
        assert torch.equal(model.state_dict()[name], t), name
    assert not torch.equal(load_model(run / "checkpoints" / "step_000000")(IDS), model(IDS))  # the newest, not any

    from jetflow.config import load_config
    from jetflow.run.build import build_policy
    cfg = load_config(run / "config.yaml")
    reference, tok = build_policy(cfg)
    reference.load_state_dict(stored, strict=False)
    reference.tie_weights()
    expected = greedy(reference.eval(), tok)
    assert model.config == reference.config
    assert cli_generate(run, capsys) == expected
    assert cli_generate(newest, capsys) == expected


def test_export_takes_what_generate_takes(run_dir, tmp_path):
    """`jetflow export --model` a run directory or one of its checkpoints (before: a run directory was
    refused): the FP8 export of the model the run resolves to, with its run's tokenizer."""
    run = older_run(run_dir, tmp_path)
    newest = run / "checkpoints" / "step_000002"
    export_fp8(load_model(run), tmp_path / "api", QuantRecipe(), tokenizer_dir=load_model_tokenizer(run))
    for source, out in ((run, tmp_path / "from-run"), (newest, tmp_path / "from-checkpoint")):
        assert main(["export", "--model", str(source), "--out", str(out)]) == 0
        for name in ("config.json", "char_tokenizer.json"):
            assert (out / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), (source, name)
        assert_same_safetensors(out / "model.safetensors", tmp_path / "api" / "model.safetensors")
    assert main(["export", "--model", str(run), "--out", str(newest)]) == 2  # its own weights: refused


def test_a_self_describing_checkpoint_loads_without_its_run(run_dir, tmp_path, capsys):
    """save_checkpoint(hf_config=True, tokenizer=...) writes config.json and the tokenizer, in the manifest."""
    model, tok = load_model(run_dir), load_model_tokenizer(run_dir)
    ckpt = save_checkpoint(tmp_path / "elsewhere", 3, model, {}, {"next_step": 3, "sft_done": True}, hf_config=True,
                           tokenizer=tok)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert {"config.json", "char_tokenizer.json", "model.safetensors", "state.json"} <= set(manifest)
    assert resolve_model_dir(ckpt).run_dir is None  # nothing around it to ask
    assert torch.equal(load_model(ckpt)(IDS), model(IDS))
    assert cli_generate(ckpt, capsys) == greedy(model, tok)


# ---- the final model of a run --------------------------------------------------------------------


@torch.no_grad()
def test_final_model_is_an_hf_directory_and_its_fp8_export(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from jetflow.config import derive, load_config
    from jetflow.run.build import load_inputs
    from jetflow.run.sides import TrainerSide

    run = older_run(run_dir, tmp_path)
    cfg = load_config(run / "config.yaml")
    side = TrainerSide(cfg, derive(cfg), load_inputs(cfg))  # as the run holds it at its end: the trained weights under unified FP8
    side.restore(latest_checkpoint(run))
    final = write_final_model(run, side.model, side.tokenizer, cfg.precision.mode, cfg.precision.recipe())
    assert final == run / FINAL_MODEL_DIR and not list(run.glob(".tmp-*"))

    stored = load_file(final / "model.safetensors")
    master = side.model.state_dict()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, master[n].bfloat16()) for n, t in stored.items())
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ours = load_model(final)
    assert (hf(IDS).logits - ours(IDS)).abs().max().item() <= 1e-5
    assert load_model_tokenizer(final).alphabet == side.tokenizer.alphabet

    # model-fp8: the bytes the trainer computed with
    exported = load_file(run / FINAL_FP8_DIR / "model.safetensors")
    for name, layer in fp8_linears(side.model).items():
        q = layer.quantized_weight()
        assert torch.equal(exported[f"{name}.weight"].view(torch.uint8), q.data.view(torch.uint8)), name
        assert torch.equal(exported[f"{name}.weight_scale_inv"], q.scale_inv), name
    assert resolve_model_dir(run / FINAL_FP8_DIR).quantized

    # the run now resolves to its final model
    assert resolve_model_dir(run).weights_dir == final
    assert torch.equal(load_model(run)(IDS), ours(IDS))
    assert cli_generate(run, capsys) == greedy(ours, side.tokenizer)

    # written on a driver that holds no trainer (a Ray run), from the final checkpoint: the same files
    driver = tmp_path / "driver"
    write_final_model(driver, load_model(latest_checkpoint(run)), load_model_tokenizer(run), "unified",
                      cfg.precision.recipe())
    for name in (FINAL_MODEL_DIR, FINAL_FP8_DIR):
        assert_same_safetensors(driver / name / "model.safetensors", run / name / "model.safetensors")
        assert (driver / name / "config.json").read_bytes() == (run / name / "config.json").read_bytes()

    # other modes: no FP8 export
    write_final_model(tmp_path / "bf16run", side.model, side.tokenizer, "bf16")
    assert (tmp_path / "bf16run" / FINAL_MODEL_DIR / "config.json").is_file()
    assert not (tmp_path / "bf16run" / FINAL_FP8_DIR).exists()


# ---- what is not a model directory ---------------------------------------------------------------


def test_a_directory_of_no_known_kind_is_one_clear_error(run_dir, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    expected = r"is not a model directory: expected a Hugging Face directory .*FP8.*run checkpoint.*run directory"
    with pytest.raises(CheckpointError, match=expected):
        load_model(tmp_path / "notes")
    assert main(["generate", "--model", str(tmp_path / "notes"), "x"]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err) and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="does not exist: expected a Hugging Face directory"):
        load_model(tmp_path / "nowhere")

    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    shutil.copy(run_dir / "config.yaml", empty_run / "config.yaml")
    with pytest.raises(CheckpointError, match="has no model/ and no checkpoint yet"):
        load_model(empty_run)

    orphan = tmp_path / "orphan"  # an older checkpoint taken out of its run
    shutil.copytree(older_run(run_dir, tmp_path / "older") / "checkpoints" / "step_000002", orphan)
    with pytest.raises(CheckpointError, match=r"has no config.json .* no run config .*config.yaml"):
        load_model(orphan)


@torch.no_grad()
def test_final_model_of_a_megatron_policy(hf_dir, tmp_path):
    """The trainer model of train.backend=megatron: weights and FP8 bytes gathered in HF names."""
    import importlib.util
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core not installed")
    from jetflow.train.megatron import MegatronPolicy

    recipe = QuantRecipe()
    policy = MegatronPolicy.from_decoder(load_model(hf_dir), kind="fp8", recipe=recipe, gemm_backend="emulate")
    final = write_final_model(tmp_path, policy, load_model_tokenizer(hf_dir), "unified", recipe)
    stored = load_file(final / "model.safetensors")
    for name, t in policy.hf_state_dict().items():
        if name in stored:
            assert torch.equal(stored[name], t.bfloat16()), name
    exported = load_file(tmp_path / FINAL_FP8_DIR / "model.safetensors")
    quantized = policy.quantized_weights()
    assert len(quantized) == 14
    for name, q in quantized.items():
        assert torch.equal(exported[f"{name}.weight"].view(torch.uint8), q.data.view(torch.uint8)), name
        assert torch.equal(exported[f"{name}.weight_scale_inv"], q.scale_inv), name
    assert torch.equal(load_model(tmp_path / FINAL_FP8_DIR)(IDS), load_model(hf_dir, precision="fp8", recipe=recipe)(IDS))
