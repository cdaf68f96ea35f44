"""A tiny reward model for examples/reward_model: a Llama sequence classifier with a character tokenizer,
trained here to prefer completions rich in vowels, saved as a Hugging Face directory.

    python examples/reward_model/make_reward_model.py runs/reward_model/rm [--steps 400] [--seed 0]

The preference is synthetic on purpose: it is known exactly (``vowel_share``), so a run can tell whether
the policy learned toward the model's preference. The texts it trains on look like the task's, a prompt
"reverse WORD:" followed by a completion of random letters; its target is the completion's share of
vowels. The tests use ``build`` (an untrained model) to check the reward-model plumbing.
"""

from __future__ import annotations

import argparse
import random
import string
from pathlib import Path

import torch

ALPHABET = string.printable[:95]  # the tiny policy's characters (printable ASCII, as jetflow's CharTokenizer)
VOWELS = set("aeiou")


def char_tokenizer(alphabet: str = ALPHABET):
    """A Hugging Face fast tokenizer with one token per character (ids 0-2: pad, bos, eos)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def build(out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2):
    """An untrained tiny reward model and its tokenizer in ``out_dir``; returns (model, tokenizer)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForSequenceClassification(config)
    save(model, tokenizer, out_dir)
    return model, tokenizer


def save(model, tokenizer, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def vowel_share(completion: str) -> float:
    """The preference the model learns: the share of the completion's characters that are vowels."""
    return sum(ch in VOWELS for ch in completion) / max(len(completion), 1)


def sample_text(rng: random.Random) -> tuple[str, float]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    p = rng.random()  # completions from consonant-only to vowel-only
    completion = "".join(rng.choice("aeiou") if rng.random() < p else rng.choice("bcdfghjklmnpqrstvwxyz")
                         for _ in range(rng.randint(1, 8)))
    return f"reverse {word}:{completion}", vowel_share(completion)


def train(out_dir: str | Path, steps: int = 400, seed: int = 0, batch: int = 64) -> float:
    """Train the tiny reward model on ``vowel_share``; returns the mean squared error on fresh texts."""
    model, tokenizer = build(out_dir, seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch_of(n):
        texts, targets = zip(*(sample_text(rng) for _ in range(n)))
        return tokenizer(list(texts), return_tensors="pt", padding=True), torch.tensor(targets)

    model.train()
    for _ in range(steps):
        inputs, targets = batch_of(batch)
        loss = torch.nn.functional.mse_loss(model(**inputs).logits[:, 0], targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        inputs, targets = batch_of(512)
        error = float(torch.nn.functional.mse_loss(model(**inputs).logits[:, 0], targets))
    save(model, tokenizer, out_dir)
    return error


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a 64-wide model: more threads only wait on each other (and on a busy core)
    mse = train(args.out_dir, args.steps, args.seed)
    print(f"reward model in {args.out_dir}: held-out mean squared error {mse:.4f} (target variance about 0.08)")
