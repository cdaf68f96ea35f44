"""Hugging Face checkpoint directories <-> `Decoder`.

A directory holds config.json and either model.safetensors or shards model-0000i-of-0000N.safetensors
with model.safetensors.index.json (its "weight_map": tensor name -> shard file). Every problem
(missing file, unreadable safetensors, missing or unexpected tensor, wrong shape) raises
CheckpointError naming the file and the tensor.

Mixture-of-experts models (Qwen3-MoE, Mixtral) are written with one tensor per expert projection under
the names of the released checkpoints (`...mlp.experts.E.gate_proj.weight`,
`...block_sparse_moe.experts.E.w1.weight`), which transformers' `save_pretrained` also writes and vLLM
reads. A directory in transformers' in-memory layout (`save_pretrained(save_original_format=False)`:
fused `mlp.experts.gate_up_proj` (E, 2I, C) and `mlp.experts.down_proj` (E, C, I), Mixtral's block
renamed `mlp`) loads too: `per_expert_layout` splits it on load.

An FP8 export (`jetflow export`: config.json with `quantization_config`, FP8 linears stored as
float8_e4m3fn + weight_scale_inv) is a directory of this layout too: `load_hf_dir` loads it with its
FP8 linears running the exported bytes (`load_fp8_dir`). Which kind of directory a path is (HF, FP8
export, run checkpoint, run) is decided in one place: `jetflow.run.sources`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jetflow.errors import UserError
from jetflow.model.decoder import Decoder, ModelConfig
from jetflow.model.moe import EXPERT_NAMES
from jetflow.model.tokenizer import CharTokenizer, Tokenizer
from jetflow.precision import QuantRecipe, apply_precision
from jetflow.precision.export import (
    SCALE_SUFFIX,
    is_scale_name,
    load_quantized_weights,
    recipe_from_quantization_config,
    split_quantized,
)
from jetflow.precision.recipe import FP8_DTYPES

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "char_tokenizer.json", "generation_config.json")
DEFAULT_SHARD_BYTES = 2 * 1024**3


class CheckpointError(UserError, RuntimeError):
    pass


def read_json(path: Path) -> dict:
    """A JSON object file of a model directory; a missing, garbled or non-object file is one
    CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot parse {path}: {e}; restore it from the model's source") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object but a {type(data).__name__}; restore it from the "
                              "model's source")
    return data


def config_from_hf(hf: dict, file: Path) -> ModelConfig:
    """ModelConfig.from_hf, with a config.json that lacks a key or has a value of the wrong type named."""
    try:
        return ModelConfig.from_hf(hf)
    except UserError as e:  # an unsupported model: the same error, naming the file
        raise type(e)(f"{file}: {e}") from None
    except KeyError as e:
        raise CheckpointError(f"{file} has no {e.args[0]!r}, which the model needs; restore the file from the "
                              "model's source") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: a value has the wrong type ({e}); restore the file from the model's "
                              "source") from None


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig from <path>/config.json: a checkpoint directory's architecture (Hugging Face's file).
    Not a run's config: that is jetflow.config.load_config (a YAML file and overrides -> Config)."""
    file = Path(path) / CONFIG_FILE
    return config_from_hf(read_json(file), file)


def write_config(config: ModelConfig, dtype: torch.dtype, path: str | Path) -> None:
    """<path>/config.json for weights of `config` stored in `dtype` (what transformers and `load_model_config` read)."""
    (Path(path) / CONFIG_FILE).write_text(json.dumps(config.to_hf(dtype), indent=2) + "\n")


def write_tokenizer(tokenizer, path: str | Path) -> None:
    """Put a tokenizer's files into directory `path`. `tokenizer`: a directory (its TOKENIZER_FILES are
    copied), a jetflow `CharTokenizer` (saved) or `Tokenizer` (the files of the directory it was read
    from), or None (nothing to write)."""
    d = Path(path)
    if tokenizer is None:
        return
    if isinstance(tokenizer, CharTokenizer):  # it is its own file
        tokenizer.save(d)
        return
    src = Path(tokenizer.path if isinstance(tokenizer, Tokenizer) else tokenizer)  # a Tokenizer knows its directory
    if src.resolve() == d.resolve():
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, d / name)


def _weight_map(d: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index or the single file's header."""
    if (d / INDEX_FILE).is_file():
        index = read_json(d / INDEX_FILE)
        if "weight_map" not in index:
            raise CheckpointError(f"{d / INDEX_FILE} has no 'weight_map'")
        files = {d / f for f in index["weight_map"].values()}
        for f in sorted(files):
            if not f.is_file():
                raise CheckpointError(f"missing shard file {f} (listed in {d / INDEX_FILE})")
        return {name: d / f for name, f in index["weight_map"].items()}
    if (d / SINGLE_FILE).is_file():
        return {name: d / SINGLE_FILE for name in _keys(d / SINGLE_FILE)}
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory does not exist: {d}")
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {d}")


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own SafetensorError / OSError on a corrupt header
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e



def _read_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype to read tensor `name` in (None: as stored). Float8 bytes and their scales stay as
    stored: a cast would turn the bytes into values without the scale they need."""
    if dtype is None or t.dtype in FP8_DTYPES.values() or name.endswith(SCALE_SUFFIX):
        return None
    return dtype


def load_state_dict_from_dir(path: str | Path, device: str | torch.device = "cpu",
                             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded), as stored (or cast to dtype;
    float8 tensors and their scales always as stored), each in a freshly allocated (aligned) tensor.
    """
    d = Path(path)
    by_file: dict[Path, list[str]] = {}
    for name, file in _weight_map(d).items():
        by_file.setdefault(file, []).append(name)
    out = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"tensor {name!r} listed in {d / INDEX_FILE} is not in {file}")
                    # a copy in memory we own: safetensors' CPU tensors point into the file buffer at
                    # offsets that are not 64-byte aligned, which made CPU matmuls ~10x slower
                    t = f.get_tensor(name)
                    out[name] = t.to(dtype=_read_dtype(name, t, dtype), copy=True)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e
    return out


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    """A `Decoder` with the weights of a local HF directory, in `dtype` on `device`.

    The model is built on the meta device (no random init, no double memory) and the checkpoint
    tensors are assigned to it. With tied embeddings a stored lm_head.weight is ignored. An FP8
    export (config.json with `quantization_config`) loads with `load_fp8_dir`."""
    d = Path(path)
    hf = read_json(d / CONFIG_FILE)
    config = config_from_hf(hf, d / CONFIG_FILE)
    if "quantization_config" in hf:
        return load_fp8_dir(d, config, export_recipe(d, hf), dtype, device)
    return load_weights(d, config, dtype, device)


def check_loaded_model(model: Decoder, tokenizer, path: str | Path) -> None:
    """A damaged weight file or a tokenizer of another model fails here, in one line, and not as a
    quantizer error or an index error in the embedding several calls later."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            bad = int((~torch.isfinite(p)).sum())
            if bad:
                raise CheckpointError(f"{path}: weight {name} holds {bad} NaN/Inf value(s); the model files are "
                                      "damaged (convert or download them again)")
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model's embedding "
                              f"{vocab}: the tokenizer belongs to another model")


def load_weights(path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Decoder:
    """A `Decoder` of `config` with the (unquantized) tensors of directory `path`; its config.json is
    not read (a run checkpoint written before checkpoints carried one is described by its run)."""
    d = Path(path)
    files = _weight_map(d)
    sd, files = per_expert_layout(load_state_dict_from_dir(d, device=device, dtype=dtype), files, config)
    return _assign(d, config, files, sd, device)


_FUSED_MOE = re.compile(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")


def per_expert_layout(sd: dict[str, torch.Tensor], files: dict[str, Path],
                      config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Tensors in transformers' in-memory MoE layout renamed and split into the per-expert checkpoint
    names the Decoder uses (other tensors pass through), with `files` (name -> file) to match.

    Fused layout (transformers >= 5): `model.layers.N.mlp.experts.gate_up_proj` (E, 2I, C), the E
    gate projections' rows then the up projections' (its converter concatenates [gate, up] on dim 1),
    `...mlp.experts.down_proj` (E, C, I), and Mixtral's router as `...mlp.gate.weight`."""
    if not config.is_moe:
        return sd, files
    out_sd, out_files = {}, {}
    for name, t in sd.items():
        m = _FUSED_MOE.fullmatch(name)
        if m is None or not config.is_moe_layer(int(m[1])):
            out_sd[name], out_files[name] = t, files[name]
            continue
        block = f"model.layers.{m[1]}.{config.moe_attr}."
        if m[2] == "gate.weight":
            new = {block + "gate.weight": t}
        elif t.ndim != 3:
            raise CheckpointError(f"tensor {name!r} in {files[name]} has shape {tuple(t.shape)}, "
                                  "expected (num_experts, out_features, in_features)")
        else:
            new = _split_experts(t, block, m[2], EXPERT_NAMES[config.model_type])
        out_sd.update(new)
        out_files.update(dict.fromkeys(new, files[name]))
    return out_sd, out_files


def _split_experts(t: torch.Tensor, block: str, fused: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """One fused expert tensor (E, out, in) -> `{block}experts.{e}.{proj}.weight` per expert (copies)."""
    gate_name, up_name, down_name = names
    out = {}
    for e in range(t.shape[0]):
        if fused == "experts.gate_up_proj":  # (E, 2I, C): gate rows, then up rows
            inter = t.shape[1] // 2
            out[f"{block}experts.{e}.{gate_name}.weight"] = t[e, :inter].clone()
            out[f"{block}experts.{e}.{up_name}.weight"] = t[e, inter:].clone()
        else:  # experts.down_proj (E, C, I)
            out[f"{block}experts.{e}.{down_name}.weight"] = t[e].clone()
    return out


def export_recipe(d: Path, hf: dict) -> QuantRecipe:
    """The FP8 recipe an export was made under, from its config.json's quantization_config."""
    try:
        return recipe_from_quantization_config(hf["quantization_config"])
    except ValueError as e:
        raise CheckpointError(f"{d / CONFIG_FILE}: {e}") from None


def load_fp8_dir(path: str | Path, config: ModelConfig, recipe: QuantRecipe, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Decoder:
    """An FP8 export as a `Decoder` under the recipe's FP8 linears, each computing with the exported
    bytes and scales as they are (never requantized: `load_quantized_weights`). Their master weights
    hold the dequantized values in `dtype`, which only a non-FP8 GEMM (another precision applied on
    top) or a bf16 / fp32 save reads. What the recipe keeps in high precision is stored in bf16 and
    loads like any HF tensor."""
    d = Path(path)
    files = _weight_map(d)
    stored = load_state_dict_from_dir(d, device=device)  # FP8 bytes, fp32 scales, bf16 others
    try:
        quantized, others = split_quantized(stored, recipe.weight_block)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"FP8 export {d}: {e}") from None
    tensors = {name: t.to(dtype) for name, t in others.items()}
    for module, q in quantized.items():
        tensors[f"{module}.weight"] = q.dequantize(dtype)  # (N, K)
    model = _assign(d, config, {n: f for n, f in files.items() if not is_scale_name(n)}, tensors, device)
    apply_precision(model, "fp8", recipe, num_layers=config.num_layers)
    try:
        load_quantized_weights(model, quantized)
    except ValueError as e:
        raise CheckpointError(f"FP8 export {d} does not fit its recipe {recipe.fingerprint()}: {e}") from None
    return model


def _assign(d: Path, config: ModelConfig, files: dict[str, Path], sd: dict[str, torch.Tensor],
            device: str | torch.device) -> Decoder:
    """A Decoder of `config` holding the tensors `sd` (read from `files`: name -> file), after checking
    their names and shapes against it. Built on the meta device: the tensors are assigned, not copied."""
    with torch.device("meta"):
        model = Decoder(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(files) - set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"checkpoint {d} is missing tensors: {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        where = ", ".join(f"{n} (in {files[n].name})" for n in unexpected[:10])
        raise CheckpointError(f"checkpoint {d} has unexpected tensors for {config.architecture}: {where}")
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, t in sd.items():
        if t.shape != expected[name]:
            raise CheckpointError(f"tensor {name!r} in {files[name]} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(expected[name])} from {d / CONFIG_FILE}")
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    model.to(device)  # the parameters are there already; this moves the RoPE buffer
    return model.eval()


def save_hf_dir(model: Decoder, path: str | Path, tokenizer_dir=None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes) that both
    `load_hf_dir` and transformers' `from_pretrained` read. Tokenizer files found in tokenizer_dir
    (or a jetflow tokenizer's, see `write_tokenizer`) are copied along. Returns the directory."""
    return save_hf_weights(model.state_dict(), model.config, path, tokenizer_dir, max_shard_bytes)


def save_hf_weights(state_dict: dict[str, torch.Tensor], config: ModelConfig, path: str | Path, tokenizer=None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """`save_hf_dir` for HF-named tensors of `config` (a Decoder's state dict, a sharded policy's gathered
    weights); config.json names the embedding's dtype."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # as HF does: shared storage cannot be saved twice anyway
    write_config(config, sd["model.embed_tokens.weight"].dtype, d)

    for old in list(d.glob("model*.safetensors")) + [d / INDEX_FILE]:
        old.unlink(missing_ok=True)  # leftovers of an earlier save would shadow this one
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(d / SINGLE_FILE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(d / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    write_tokenizer(tokenizer, d)
    return d
