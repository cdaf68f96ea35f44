"""`jetflow generate`: prompts in, completions out, through the native rollout engine."""

from __future__ import annotations

import torch

from jetflow.errors import UsageError
from jetflow.model.tokenizer import TokenizerError, encode_prompt, eos_token_ids
from jetflow.precision.modes import LINEAR_KINDS
from jetflow.rollout.engine import RolloutEngine
from jetflow.rollout.sampling import SamplingParams

PRECISIONS = LINEAR_KINDS  # --precision: the linears' GEMM kind


def encode_numbered_prompt(tok, prompt: str, chat: bool, index: int) -> list[int]:
    """A prompt's token ids as a run encodes them; text the tokenizer cannot encode is one line naming the prompt."""
    try:
        return encode_prompt(tok, prompt, chat)
    except TokenizerError as e:
        raise TokenizerError(f"prompt {index}: {e}") from None


def check_positions(ids: list[list[int]], max_new_tokens: int, max_positions: int) -> None:
    """Refuse a prompt that, with room for max_new_tokens, runs past the model's positions: tokens
    there would sit at positions the model was never trained on (RoPE extrapolation), silently."""
    for i, prompt in enumerate(ids):
        need = len(prompt) + max_new_tokens
        if need <= max_positions:
            continue
        if len(prompt) < max_positions:
            fix = f"lower --max-new-tokens to {max_positions - len(prompt)} or shorten the prompt"
        elif max_new_tokens < max_positions:
            fix = f"shorten the prompt to at most {max_positions - max_new_tokens} tokens"
        else:
            fix = f"lower --max-new-tokens below {max_positions} and shorten the prompt"
        raise UsageError(f"prompt {i} is {len(prompt)} tokens and --max-new-tokens {max_new_tokens} needs room for "
                         f"{max_new_tokens} more ({need} positions), but the model has {max_positions} positions "
                         f"(max_position_embeddings); {fix}")


def generate_main(model_path: str, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int = 0, chat: bool = True, precision: str = "fp32",
                  device: str | None = None, print_output: bool = True, load=None) -> list[str]:
    """Generate a completion for each prompt and print it. `chat` renders each prompt as one user
    message with the tokenizer's chat template (when it has one). `precision` is the linear kind
    applied to the model: fp32, bf16 or fp8 (the FP8 recipe, emulated on the CPU). `load`: a pair of
    functions (model loader, tokenizer loader) for directories jetflow.model.load does not read (a run)."""
    from jetflow.model import load as load_model, load_tokenizer
    from jetflow.precision import QuantRecipe, apply_precision

    if load is not None:
        load_model, load_tokenizer = load

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: valid precisions are {PRECISIONS}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = load_tokenizer(model_path)
    ids = [encode_numbered_prompt(tok, p, chat, i) for i, p in enumerate(prompts)]
    model = load_model(model_path, device=dev).eval()
    check_positions(ids, max_new_tokens, model.config.max_position_embeddings)
    if precision != "fp32":
        apply_precision(model, precision, QuantRecipe() if precision == "fp8" else None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    engine = RolloutEngine(model, eos_token_ids(tok, model.config), pad, max_batch=min(len(ids), 32),
                           max_seq_len=max(map(len, ids)) + max_new_tokens, device=dev, tokenizer=tok)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    out = engine.generate(ids, params, seeds=[seed + i for i in range(len(ids))])
    if print_output:
        for i, (prompt, text, reason) in enumerate(zip(prompts, out.texts, out.finish_reasons)):
            print(f"=== [{i}] {prompt}\n{text}\n--- ({len(out.token_ids[i])} tokens, {reason})", flush=True)
    return out.texts
