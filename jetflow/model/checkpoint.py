"""Hugging Face checkpoint directories <-> `Decoder`.

A directory holds config.json and either model.safetensors or shards model-0000i-of-0000N.safetensors
with model.safetensors.index.json (its "weight_map": tensor name -> shard file). Every problem
(missing file, unreadable safetensors, missing or unexpected tensor, wrong shape) raises
CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jetflow.errors import UserError
from jetflow.model.decoder import Decoder, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "char_tokenizer.json", "generation_config.json")
DEFAULT_SHARD_BYTES = 2 * 1024**3


class CheckpointError(UserError, RuntimeError):
    pass


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot parse {path}: {e}") from e


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from <path>/config.json."""
    return ModelConfig.from_hf(read_json(Path(path) / "config.json"))


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


def load_state_dict_from_dir(path: str | Path, device: str | torch.device = "cpu",
                             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded), as stored (or cast to dtype),
    each in a freshly allocated (aligned) tensor."""
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
                    out[name] = f.get_tensor(name).to(dtype=dtype, copy=True)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e
    return out


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    """A `Decoder` with the weights of a local HF directory, in `dtype` on `device`.

    The model is built on the meta device (no random init, no double memory) and the checkpoint
    tensors are assigned to it. With tied embeddings a stored lm_head.weight is ignored."""
    d = Path(path)
    config = load_config(d)
    with torch.device("meta"):
        model = Decoder(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    files = _weight_map(d)
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(files) - set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"checkpoint {d} is missing tensors: {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        where = ", ".join(f"{n} (in {files[n].name})" for n in unexpected[:10])
        raise CheckpointError(f"checkpoint {d} has unexpected tensors for {config.architecture}: {where}")
    sd = load_state_dict_from_dir(d, device=device, dtype=dtype)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, t in sd.items():
        if t.shape != expected[name]:
            raise CheckpointError(f"tensor {name!r} in {files[name]} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(expected[name])} from {d / 'config.json'}")
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    model.to(device)  # the parameters are there already; this moves the RoPE buffer
    return model.eval()


def save_hf_dir(model: Decoder, path: str | Path, tokenizer_dir: str | Path | None = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes) that both
    `load_hf_dir` and transformers' `from_pretrained` read. Tokenizer files found in tokenizer_dir
    are copied along. Returns the directory."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # as HF does: shared storage cannot be saved twice anyway
    dtype = model.model.embed_tokens.weight.dtype
    (d / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2) + "\n")

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

    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and src.resolve() != d.resolve():
                shutil.copy2(src / name, d / name)
    return d
