"""A reward model: a local Hugging Face sequence-classification model that scores each completion.

Named in ``task.params.reward`` beside (or instead of) functions, with its weight in ``reward_weights``::

    reward: [model:runs/rm/hf, my_rewards:format]     # a directory with config.json, weights and tokenizer
    reward_model_dtype: float32                       # or bfloat16
    reward_model_batch_size: 16

Each completion is scored as TRL's GRPOTrainer scores one with a reward model: a chat prompt and its
completion messages rendered by the reward model's own chat template, a text prompt and its text
completion concatenated; tokenized without special tokens, right-padded, in batches; the reward is the
first logit (the ``score`` head of a ``...ForSequenceClassification`` with ``num_labels=1``).

The directory is checked when the task is built, before any weight loads (the policy's or its own): a
config of a model without a score head, a score of more than one label, a tokenizer or an embedding
whose vocabulary is not the config's. Its weights load on the first batch it scores, in the process that
scores (the one that runs the RL loop). A NaN or infinite score names the row (RewardError).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jetflow.tasks.rewards import MODEL_PREFIX, RewardError, checked_values, first_line, is_reward_model

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""task.params.reward_model_dtype's values and the bytes of a weight in each (the memory estimate's width)."""
DEFAULT_DTYPE = "float32"


def reward_model_dtype(params: dict) -> str:
    """The dtype a custom task's reward models score in, from its task.params."""
    return params.get("reward_model_dtype", DEFAULT_DTYPE)


def reward_model_dirs(specs: str | list | None) -> list[Path]:
    """The directories of the reward models among ``task.params.reward``'s entries (one spec or a list)."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    return [Path(s[len(MODEL_PREFIX):]) for s in specs if is_reward_model(s)]


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every weight's shape, read from the safetensors headers (no weight is loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(directory):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def num_parameters(directory: Path) -> int:
    """The reward model's parameter count (the memory estimate's term)."""
    return sum(math.prod(shape) for shape in tensor_shapes(directory).values())


class RewardModel:
    """One ``model:DIR`` entry of the task's rewards, with its weight; called like a RewardFunction."""

    def __init__(self, spec: str, weight: float = 1.0, dtype: str = DEFAULT_DTYPE, batch_size: int = 16):
        self.spec, self.weight, self.batch_size = spec, float(weight), int(batch_size)
        self.directory = Path(spec[len(MODEL_PREFIX):])
        if dtype not in DTYPE_BYTES:
            raise RewardError(f"task.params.reward_model_dtype={dtype!r}: one of {', '.join(DTYPE_BYTES)}")
        if self.batch_size < 1:
            raise RewardError(f"task.params.reward_model_batch_size={batch_size}: at least 1")
        self.dtype = dtype
        self._model: Any = None  # loaded on the first batch
        self._tokenizer: Any = None  # loaded by the directory's check
        self._check_directory()

    @property
    def name(self) -> str:
        return self.directory.name or self.spec

    def check_signature(self, columns: list[str]) -> None:
        """A model takes every batch (the data's other columns are not its input)."""

    def _check_directory(self) -> None:
        d, spec = self.directory, self.spec
        if not (d / "config.json").is_file():
            raise RewardError(f"reward {spec}: no config.json in {d} (a reward model is a local Hugging Face directory "
                              "of a sequence-classification model)")
        config = json.loads((d / "config.json").read_text())
        archs = config.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise RewardError(f"reward {spec}: {d} holds a {', '.join(archs) or 'model'} with no score head; a reward "
                              "model is a ...ForSequenceClassification with num_labels=1 (one score a completion)")
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
        if labels != 1:
            raise RewardError(f"reward {spec}: its score head has {labels} labels; a reward model scores with one "
                              "(num_labels=1)")
        if not _weight_files(d):
            raise RewardError(f"reward {spec}: no *.safetensors weights in {d}")
        shapes = tensor_shapes(d)
        heads = [n for n in shapes if n.split(".")[-2:-1] in (["score"], ["classifier"])]
        if not heads:
            raise RewardError(f"reward {spec}: its weights have no score head (no score.weight in {d}); save the "
                              "sequence-classification model, not its base")
        vocab = config.get("vocab_size")
        embeddings = [s[0] for n, s in shapes.items() if n.endswith("embed_tokens.weight")]
        if vocab is not None and embeddings and embeddings[0] != vocab:
            raise RewardError(f"reward {spec}: its embedding has {embeddings[0]} rows and its config says vocab_size="
                              f"{vocab}: the weights are not the config's model")
        self._tokenizer = self._load_tokenizer()
        tokens = len(self._tokenizer)
        if vocab is not None and tokens > vocab:
            raise RewardError(f"reward {spec}: its tokenizer has {tokens} tokens and the model vocab_size={vocab}: "
                              "the tokenizer is not the model's")

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.directory))
        except (OSError, ValueError) as e:
            raise RewardError(f"reward {self.spec}: its tokenizer does not load ({first_line(e)})") from None
        if tokenizer.pad_token is None:  # batches are right-padded; the head reads the last real token
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        return tokenizer

    def _load(self):
        import torch
        from transformers import AutoModelForSequenceClassification

        if self._model is None:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(self.directory), dtype=getattr(torch, self.dtype))
            model.config.pad_token_id = self._tokenizer.pad_token_id
            self._model = model.eval()
        return self._model

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Each (prompt, completion) as the reward model reads it (TRL's rendering)."""
        if prompts and not isinstance(prompts[0], str):  # conversational: the model's own chat template
            if self._tokenizer.chat_template is None:
                raise RewardError(f"reward {self.spec}: a chat prompt needs the reward model's chat template, and its "
                                  "tokenizer has none")
            return [self._tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                    for p, c in zip(prompts, completions)]
        return [p + (c if isinstance(c, str) else "".join(m["content"] for m in c))
                for p, c in zip(prompts, completions)]

    def __call__(self, prompts: list, completions: list, columns: dict[str, list], rows: list[str]
                 ) -> list[float | None]:
        """The first logit of each rendered (prompt, completion), in batches of batch_size."""
        import torch

        model, texts, scores = self._load(), self.texts(prompts, completions), []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                        add_special_tokens=False)
                scores += model(**batch).logits[:, 0].float().tolist()  # (b,)
        return checked_values(self.spec, scores, rows)
