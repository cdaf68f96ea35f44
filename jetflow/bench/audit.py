"""`jetflow audit`: where the FP8 recipe's error enters on a user's own model (issue 70).

    jetflow audit --model smollm2 [--config F] [key=value ...] [--out DIR] [--target-kl 1e-3]

On one batch of the task's rollouts (sampled by the model itself in bf16, the bf16 mode's trainer), each
linear the recipe quantizes is switched to the recipe alone, then each group of them (a decoder layer, a
projection kind across the layers, all of them), and its effect is measured against the bf16 trainer:

- log-probs: KL(bf16 || FP8) over the whole vocabulary at each response position (mean), the largest
  |delta log p| of a sampled token, and the share of positions whose greedy token flips;
- one GRPO step's gradient: at a step's start (ratio 1) GRPO's gradient is the policy gradient
  sum_t A * grad log p_t / tokens; its wgrad (every parameter's gradient) and dgrad (the gradient reaching the
  embedding output, through every layer's backward) against bf16's: relative error ||g - g_ref|| / ||g_ref||
  and cosine. The advantages are the task's group-normalized rewards, or +1 / -1 alternating where every
  reward of the batch is the same (a direction to compare, not a learning signal).

One forward and one backward per group, the GEMMs in the run's recipe on fast numerics (on a CPU its
emulation, which rounds as the recipe does). Then `keep_*` settings: the linears the recipe keeps in bf16
(precision.keep_first_layers / keep_last_layers, precision.keep_high_precision patterns by projection kind),
added greedily in the order of their own damage until the model with everything else quantized is within
`target_kl` (each try one forward). Writes audit.json, audit.md (sorted tables) and audit.png to --out.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from jetflow.config import Config, derive, load_config
from jetflow.model import Decoder
from jetflow.precision import QuantRecipe
from jetflow.precision.linear import PrecisionLinear, layer_index
from jetflow.rl.advantage import group_advantages
from jetflow.rl.experience import Experience, pack_experience
from jetflow.rollout.native import NativeRollout
from jetflow.run.build import RunInputs, apply_mode, build_model, load_inputs, stop_token_ids
from jetflow.run.loop import request_seed

KINDS = ("linear", "layer", "projection", "all")


@dataclasses.dataclass
class GroupEffect:
    """One group of linears quantized alone: its effect on the log-probs and on a GRPO step's gradient."""

    group: str
    kind: str  # linear | layer | projection | all
    linears: int
    kl: float  # mean over response positions of KL(bf16 || FP8), whole vocabulary
    max_abs_dlogp: float  # of a sampled token
    flip_frac: float  # positions whose greedy token differs
    wgrad_rel_err: float
    wgrad_cos: float
    dgrad_rel_err: float
    dgrad_cos: float


def audit_config(model: str, config: str | None, overrides: list[str]) -> tuple[Config, Decoder | None]:
    """The config the audit reads (task, rollout lengths, recipe) and the model, for --model: a run directory
    (its config.yaml with the overrides, and its final model or newest checkpoint), else --config (default:
    the built-in defaults) with model.path=--model (smollm2, tiny or a Hugging Face directory; built by the
    config, so None here)."""
    from jetflow.run.sources import RUN, directory_kind, load_model

    if directory_kind(Path(model)) == RUN:
        return load_config(str(Path(model) / "config.yaml"), overrides), load_model(model)
    return load_config(config, [f"model.path={model}", *overrides]), None


def quantized_linears(model: nn.Module, recipe: QuantRecipe) -> dict[str, PrecisionLinear]:
    """The linears the recipe quantizes by their names (its keep_high_precision patterns, but every layer:
    keep_first_layers / keep_last_layers are what the audit chooses)."""
    every_layer = dataclasses.replace(recipe, keep_first_layers=0, keep_last_layers=0)
    return {n: m for n, m in model.named_modules() if isinstance(m, PrecisionLinear)
            and not every_layer.keeps_in_high_precision(n, layer_index(n), None)}


def projection(name: str) -> str:
    """The projection kind of a linear: its name's last part (q_proj, down_proj, ...)."""
    return name.rsplit(".", 1)[-1]


def module_groups(names: list[str]) -> list[tuple[str, str, list[str]]]:
    """(group, kind, linear names): each linear, each layer, each projection kind, and all of them."""
    groups = [(n, "linear", [n]) for n in names]
    layers: dict[int, list[str]] = {}
    kinds: dict[str, list[str]] = {}
    for n in names:
        index = layer_index(n)
        if index is not None:
            layers.setdefault(index, []).append(n)
        kinds.setdefault(projection(n), []).append(n)
    groups += [(f"layer {i}", "layer", ns) for i, ns in sorted(layers.items())]
    groups += [(f"*{k}*", "projection", ns) for k, ns in kinds.items()]
    return groups + [("all", "all", list(names))]


class Probe:
    """The bf16 trainer's log-probs and gradient on one batch, and any group's FP8 effect against them."""

    def __init__(self, model: Decoder, exp: Experience, advantages: Tensor, linears: dict[str, PrecisionLinear],
                 recipe: QuantRecipe, gemm_backend: str, temperature: float):
        self.model, self.exp, self.linears, self.recipe = model, exp, linears, recipe
        self.gemm_backend, self.temperature = gemm_backend, temperature
        self.mask = exp.response_mask > 0  # (B, R)
        self.coef = advantages[:, None].expand_as(self.mask) * self.mask / self.mask.sum()  # (B, R)
        self.ref_logp, self.ref_grads, self.ref_dgrad = self._pass(set(), with_grad=True)

    def _set(self, quantized: set[str]) -> None:
        for name, linear in self.linears.items():
            kind = "fp8" if name in quantized else "bf16"
            if linear.kind != kind:
                linear.set_precision(kind, self.recipe, self.gemm_backend, "fast")

    def _pass(self, quantized: set[str], with_grad: bool) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """log-softmax over the vocabulary at the response positions (B, R, V), and with `with_grad` the
        policy gradient's wgrad {parameter: grad} and dgrad at the embedding output (B, T, C)."""
        self._set(quantized)
        exp, P, R = self.exp, self.exp.prompt_len, self.exp.response_ids.shape[1]
        held: dict[str, Tensor] = {}

        def keep(module, args, out):
            out.retain_grad()
            held["embedded"] = out
        embed: nn.Module = self.model.model.embed_tokens  # type: ignore[assignment]
        hook = embed.register_forward_hook(keep) if with_grad else None
        try:
            with torch.set_grad_enabled(with_grad):
                hidden = self.model.forward_hidden(exp.input_ids, attention_mask=exp.attention_mask)  # (B, P + R, C)
                logits = self.model.lm_head(hidden[:, P - 1:P + R - 1]).float() / self.temperature  # (B, R, V)
                logp = torch.log_softmax(logits, dim=-1)  # (B, R, V)
                if not with_grad:
                    return logp, {}, logp.new_zeros(())
                sampled = logp.gather(-1, exp.response_ids.unsqueeze(-1)).squeeze(-1)  # (B, R)
                self.model.zero_grad(set_to_none=True)
                (-(self.coef * sampled).sum()).backward()
            grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
            dgrad = held["embedded"].grad
            assert dgrad is not None
            return logp.detach(), grads, dgrad.detach().clone()
        finally:
            if hook is not None:
                hook.remove()
            self.model.zero_grad(set_to_none=True)

    def logprob_effect(self, logp: Tensor) -> tuple[float, float, float]:
        """(mean KL(bf16 || this), max |delta log p| of a sampled token, greedy flip share) over the mask."""
        ref, m = self.ref_logp, self.mask
        kl = (ref.exp() * (ref - logp)).sum(-1)  # (B, R)
        ids = self.exp.response_ids.unsqueeze(-1)
        dlogp = (logp.gather(-1, ids) - ref.gather(-1, ids)).squeeze(-1).abs()  # (B, R)
        flips = logp.argmax(-1) != ref.argmax(-1)  # (B, R)
        return float(kl[m].mean()), float(dlogp[m].max()), float(flips[m].float().mean())

    def kl(self, quantized: set[str]) -> float:
        """The mean KL to bf16 with `quantized` in FP8 (one forward, no gradient)."""
        return self.logprob_effect(self._pass(quantized, with_grad=False)[0])[0]

    def effect(self, group: str, kind: str, names: list[str]) -> GroupEffect:
        logp, grads, dgrad = self._pass(set(names), with_grad=True)
        kl, dlogp, flips = self.logprob_effect(logp)
        w_err, w_cos = compare(list(grads.values()), [self.ref_grads[n] for n in grads])
        d_err, d_cos = compare([dgrad], [self.ref_dgrad])
        return GroupEffect(group, kind, len(names), kl, dlogp, flips, w_err, w_cos, d_err, d_cos)


def compare(got: list[Tensor], ref: list[Tensor]) -> tuple[float, float]:
    """(||got - ref|| / ||ref||, cosine) of the tensors taken as one vector, in float64."""
    diff = sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(got, ref))
    ref2 = sum(float(r.double().pow(2).sum()) for r in ref)
    got2 = sum(float(g.double().pow(2).sum()) for g in got)
    dot = sum(float((g.double() * r.double()).sum()) for g, r in zip(got, ref))
    return math.sqrt(diff / ref2) if ref2 else math.inf, dot / math.sqrt(ref2 * got2) if ref2 and got2 else 0.0


def keep_settings(probe: Probe, effects: list[GroupEffect], num_layers: int, target_kl: float) -> dict:
    """precision.keep_* settings that bring the quantized model within target_kl of bf16: the first layers, the
    last layers and whole projection kinds, each tried in the order of its own damage (the larger of the first /
    last layer's, a projection kind's), kept while the KL is above the target; each try is one forward. Each
    candidate is the recipe with those keep_* fields, and its FP8 linears are the ones it does not keep
    (QuantRecipe.keeps_in_high_precision, as a run decides)."""
    by_group = {e.group: e for e in effects}
    recipe = dataclasses.replace(probe.recipe, keep_first_layers=0, keep_last_layers=0)

    def fp8(r: QuantRecipe) -> set[str]:
        return {n for n in probe.linears if not r.keeps_in_high_precision(n, layer_index(n), num_layers)}
    kl = by_group["all"].kl
    trials: list[tuple[float, str, int]] = [(kl, "start", len(probe.linears))]
    candidates = sorted((e for e in effects if e.kind == "projection"), key=lambda e: -e.kl)
    quantized = fp8(recipe)
    while kl > target_kl and quantized:
        first, last = recipe.keep_first_layers, recipe.keep_last_layers
        options = []
        if first + last < num_layers:
            options.append((by_group.get(f"layer {first}", by_group["all"]).kl, "first"))
            options.append((by_group.get(f"layer {num_layers - 1 - last}", by_group["all"]).kl, "last"))
        options += [(e.kl, e.group) for e in candidates if e.group not in recipe.keep_high_precision]
        if not options:
            break
        _, choice = max(options)
        if choice == "first":
            recipe = dataclasses.replace(recipe, keep_first_layers=first + 1)
        elif choice == "last":
            recipe = dataclasses.replace(recipe, keep_last_layers=last + 1)
        else:
            recipe = dataclasses.replace(recipe, keep_high_precision=(*recipe.keep_high_precision, choice))
        quantized = fp8(recipe)
        kl = probe.kl(quantized)
        trials.append((kl, choice, len(quantized)))
    overrides = [f"precision.keep_first_layers={recipe.keep_first_layers}",
                 f"precision.keep_last_layers={recipe.keep_last_layers}"]
    if recipe.keep_high_precision != probe.recipe.keep_high_precision:
        overrides.append("precision.keep_high_precision=[" + ",".join(f'"{p}"' for p in recipe.keep_high_precision) + "]")
    return {"target_kl": target_kl, "kl": kl, "reached": kl <= target_kl, "overrides": overrides,
            "fp8_linears": len(quantized), "of": len(probe.linears),
            "trials": [{"kl": k, "kept": c, "fp8_linears": n} for k, c, n in trials]}


def rollout_batch(cfg: Config, model: Decoder, inputs: RunInputs, prompts: int) -> tuple[Experience, Tensor, list[float]]:
    """`prompts` x rollout.group_size samples from the model (the bf16 trainer's copy) with the run's native
    rollout; the Experience, the GRPO advantages (see the module docstring) and the rewards."""
    task, tokenizer = inputs.task, cast(Any, inputs.tokenizer)  # a CharTokenizer or a Hugging Face one
    problems = [p for p in task.problems(0, prompts, seed=cfg.run.seed) for _ in range(cfg.rollout.group_size)]
    prompt_ids = [inputs.renderer.prompt_ids(p.prompt) for p in problems]
    rollout = NativeRollout(model, cfg, tokenizer, stop_token_ids(tokenizer, model, task), task.stop,
                            max_seq_len=max(map(len, prompt_ids)) + cfg.rollout.max_new_tokens + 8, fingerprint=None)
    out = rollout.generate(prompt_ids, [request_seed(cfg.run.seed, 0, i) for i in range(len(prompt_ids))])
    rewards = [r.total for r in task.score_batch(problems, out.texts)]
    r = torch.tensor(rewards)
    if float(r.max() - r.min()) > 0:
        advantages = group_advantages(r, cfg.rollout.group_size)
    else:  # one reward for all: a direction to compare, +1 / -1 alternating
        advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(rewards))])
    exp = pack_experience(prompt_ids, out.token_ids, out.logprobs, r, advantages, tokenizer.pad_token_id,
                          cfg.model.device)
    return exp, advantages, rewards


def run_audit(cfg: Config, model: Decoder | None = None, prompts: int = 2, target_kl: float = 1e-3,
              kinds: tuple[str, ...] = KINDS, progress=None) -> dict:
    """The audit of cfg's model (or `model`, already loaded) under cfg's recipe: a dict with the groups'
    effects (sorted by KL within each kind), the keep_* settings and the run time."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.run.seed)
    inputs = load_inputs(cfg)  # the tokenizer, the architecture and the task, read once
    model = model if model is not None else build_model(cfg, inputs.arch, inputs.tokenizer)
    bf16 = copy.deepcopy(cfg)
    bf16.precision.mode, bf16.precision.numerics = "bf16", "fast"
    apply_mode(model, derive(bf16).precision, "trainer")  # the bf16 trainer: bf16 linears, embedding grid, K/V rounding
    precision = derive(cfg).precision
    recipe, backend = precision.recipe, precision.gemm_backend
    exp, advantages, rewards = rollout_batch(cfg, model, inputs, prompts)
    linears = quantized_linears(model, recipe)
    if not linears:
        raise ValueError("the recipe quantizes no linear of this model (precision.keep_high_precision keeps them all)")
    probe = Probe(model, exp, advantages, linears, recipe, backend, cfg.rollout.temperature)
    groups = [g for g in module_groups(list(linears)) if g[1] in kinds or g[1] == "all"]
    effects = []
    for i, (group, kind, names) in enumerate(groups):
        effects.append(probe.effect(group, kind, names))
        if progress is not None:
            progress(i + 1, len(groups), effects[-1])
    num_layers = model.config.num_layers
    keep = keep_settings(probe, effects, num_layers, target_kl)
    probe._set(set())
    order = {k: i for i, k in enumerate(KINDS)}
    effects.sort(key=lambda e: (order[e.kind], -e.kl))
    return {"model": cfg.model.path, "recipe": recipe.fingerprint(), "recipe_fields": dataclasses.asdict(recipe),
            "gemm_backend": backend, "sequences": int(exp.response_ids.shape[0]),
            "response_tokens": int(probe.mask.sum()), "rewards": rewards,
            "advantages": "group-normalized rewards" if len(set(rewards)) > 1 else "+1 / -1 alternating (one reward for all)",
            "effects": [dataclasses.asdict(e) for e in effects], "keep": keep, "seconds": time.perf_counter() - t0}


def write_report(audit: dict, out: Path, top: int = 20) -> str:
    """audit.json, audit.md (a table per kind, sorted by KL; the keep_* settings) and audit.png (the KL of each
    layer and of each projection kind, and the largest single linears); returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(audit, indent=1) + "\n")
    keep = audit["keep"]
    lines = [f"# jetflow audit: {audit['model']}, recipe {audit['recipe']} ({audit['gemm_backend']} GEMMs)", "",
             f"{audit['sequences']} sequences, {audit['response_tokens']} response tokens; advantages: "
             f"{audit['advantages']}; {audit['seconds']:.0f} s.", "",
             f"To stay within KL {keep['target_kl']:g} of bf16 ({'reached' if keep['reached'] else 'not reached'}: "
             f"{keep['kl']:.3g}, {keep['fp8_linears']} of {keep['of']} linears in FP8): `{' '.join(keep['overrides'])}`", ""]
    header = ("| group | linears | KL(bf16 \\|\\| FP8) | max \\|dlogp\\| | greedy flips | wgrad rel. err | wgrad cos "
              "| dgrad rel. err | dgrad cos |\n|---|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        rows = [e for e in audit["effects"] if e["kind"] == kind]
        if not rows:
            continue
        shown = rows[:top] if kind == "linear" else rows
        lines += [f"## {kind}" + (f" (the {len(shown)} largest of {len(rows)})" if len(shown) < len(rows) else ""), "",
                  header]
        lines += [f"| {e['group']} | {e['linears']} | {e['kl']:.3g} | {e['max_abs_dlogp']:.3g} | {e['flip_frac']:.3f} "
                  f"| {e['wgrad_rel_err']:.3g} | {e['wgrad_cos']:.5f} | {e['dgrad_rel_err']:.3g} | {e['dgrad_cos']:.5f} |"
                  for e in shown]
        lines.append("")
    text = "\n".join(lines)
    (out / "audit.md").write_text(text)
    _plot(audit, out / "audit.png", top)
    return text


def _plot(audit: dict, path: Path, top: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    effects = audit["effects"]
    layers = sorted((e for e in effects if e["kind"] == "layer"), key=lambda e: int(e["group"].split()[1]))
    kinds = [e for e in effects if e["kind"] == "projection"]
    linears = [e for e in effects if e["kind"] == "linear"][:top]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, rows, title in ((axes[0], layers, "each layer in FP8 alone"), (axes[1], kinds, "each projection kind"),
                            (axes[2], linears, f"the {len(linears)} largest single linears")):
        labels = [e["group"].replace("layer ", "").replace("model.layers.", "") for e in rows]
        ax.bar(range(len(rows)), [e["kl"] for e in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("KL(bf16 || FP8) per token")
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"jetflow audit: {audit['model']} ({audit['recipe']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
