"""Native trainer: AdamW on fp32 master weights, warmup + cosine LR, micro-batches with gradient
accumulation, gradient clipping, and NaN/Inf steps skipped and counted.

The model's linear layers already compute under the precision mode (jetflow.precision.apply_precision):
bf16 GEMMs, or FP8 fprop/dgrad/wgrad under `unified`. The master weights and the optimizer stay fp32.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch import Tensor

from jetflow.config import AlgoConfig, MemorySavers, TrainConfig, loss_aggregation
from jetflow.distributed import SINGLE, DataParallel
from jetflow.model.moe import replay_flip_fraction
from jetflow.model.chunked_logprobs import chunked_token_logprobs
from jetflow.model.logprobs import token_logprobs, token_logprobs_and_entropy
from jetflow.errors import UserError
from jetflow.precision import NonFiniteError, defer_nonfinite
from jetflow.precision.lora import has_lora
from jetflow.rl import agg_denominator, apply_correction, policy_loss
from jetflow.rl.correction import ROW_LOCAL
from jetflow.rl.experience import Experience
from jetflow.train.checkpointing import enable_activation_checkpointing
from jetflow.train.packing import PackedBatch, head_logprobs, micro_batches, on_grid, packed_response_logprobs, \
    use_packing_grid
from jetflow.train.reference import reference_nbytes


class TrainingDiverged(UserError, RuntimeError):
    """Too many consecutive steps had a NaN/Inf loss or gradient."""


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warmup to 1, then cosine decay to min_ratio at total_steps."""
    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: the matrices of the linears decay by `weight_decay`; norms and biases
    (1-D) do not (nanoGPT's configure_optimizers draws the same line), nor does the embedding (with an
    lm_head tied to it, on any pipeline stage), which nanoGPT does decay: jetflow's choice, so that the
    rows of tokens a batch never samples keep their pretrained values. Empty groups are left out."""
    tied = model.config.tie_word_embeddings

    def decays(name: str, p: nn.Parameter) -> bool:
        return p.ndim >= 2 and "embed" not in name and not (tied and ("lm_head" in name or "output_layer" in name))

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay, "decay": True},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0, "decay": False}]
    return [g for g in groups if g["params"]]


def response_logprobs(model: nn.Module, exp: Experience, temperature: float = 1.0,
                      with_entropy: bool = False, hidden: Tensor | None = None,
                      chunk_tokens: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """log pi(a_t | s_t) of the response tokens under `model`: (B, R), fp32; with `with_entropy`,
    also the policy's entropy at each response position (B, R), detached.

    Only the R columns that predict response tokens go through lm_head (the vocab projection is the largest
    GEMM of a small model; on packing's grid only the real ones). Logits are divided by the sampling
    temperature, as in the rollout. `hidden`: the final hidden states (B, P + R, C) when already computed (a
    pipeline's last stage). `chunk_tokens` > 0: that many positions through lm_head at a time
    (train.logprob_chunk_tokens), 0: all at once; both through jetflow.model.chunked_logprobs, whose backward
    sums the head's gradient over fixed groups: the same bits with chunking on and off. A head that is no
    module (Megatron's vocabulary-parallel method) takes the plain path. A PackedBatch runs its packed row."""
    if isinstance(exp, PackedBatch):
        return packed_response_logprobs(model, exp, temperature, with_entropy, chunk_tokens)
    P, R = exp.prompt_len, exp.response_ids.shape[1]
    if hidden is None:
        replay = {} if exp.routed_experts is None else {"routed_experts": exp.routed_experts}  # MoE routing replay
        hidden = model.forward_hidden(exp.input_ids, attention_mask=exp.attention_mask, **replay)  # (B, P + R, C)
    if isinstance(model.lm_head, nn.Module) and on_grid(model):
        return head_logprobs(model.lm_head, hidden[:, P - 1:P + R - 1], exp, temperature, chunk_tokens, with_entropy)
    if isinstance(model.lm_head, nn.Module):
        return chunked_token_logprobs(model.lm_head, hidden[:, P - 1:P + R - 1], exp.response_ids, temperature,
                                      chunk_tokens, with_entropy)  # (B, R) [, (B, R)]
    logits = model.lm_head(hidden[:, P - 1:P + R - 1])  # (B, R, V)
    if with_entropy:  # the same log-probs (one log_softmax), and the entropy from it
        return token_logprobs_and_entropy(logits, exp.response_ids, temperature)
    return token_logprobs(logits, exp.response_ids, temperature)  # (B, R), the rollout engine's function


@runtime_checkable
class PipelinedPolicy(Protocol):
    """A model split into pipeline stages (the Megatron backend with pipeline_parallel_size > 1): no stage runs
    `forward_hidden` alone, so the Trainer hands a step's micro-batches to the model's schedule and computes the
    loss in `head` on the last stage, from its final hidden states (MegatronPolicy.pipeline_forward_backward)."""

    pp_size: int

    def pipeline_forward_backward(self, inputs: list[tuple[Tensor, Tensor | None]],
                                  head: Callable[[int, Tensor], tuple[Tensor | None, Any]],
                                  forward_only: bool = False) -> list[Any]: ...


def pipelined(model: nn.Module) -> bool:
    return isinstance(model, PipelinedPolicy) and model.pp_size > 1


def _stage_inputs(micro: list[Experience]) -> list[tuple[Tensor, Tensor]]:
    return [(mb.input_ids, mb.attention_mask) for mb in micro]


class Trainer:
    """The policy's optimizer side in this process: what the RL loop calls (jetflow.train.protocol.
    PolicyTrainer) on a `TrainablePolicy`, which answers the questions whose answer depends on how it is laid
    out (jetflow.model.protocol): its gradients' reduction and norm, whether its forward is a collective (Megatron
    with expert parallelism: the token dispatch over the expert-parallel group; FSDP's all-gathers: every rank
    then runs every micro-batch, one without response tokens included with loss weight 0, or the others would
    wait), its router loss. A sharded policy answers over its shards.

    `savers`: the memory savers it runs (train.activation_checkpointing, train.logprob_chunk_tokens), the run's
    with `auto` resolved (jetflow.config.Derived.savers); default: train's explicit values, `auto` off."""

    def __init__(self, model: nn.Module, train: TrainConfig, algo: AlgoConfig, total_steps: int | None = None,
                 dp: DataParallel = SINGLE, loss_scale: float | None = None, savers: MemorySavers | None = None):
        self.model, self.cfg, self.algo = model, train, algo
        self.savers = MemorySavers.of(train) if savers is None else savers
        self.loss_scale = loss_scale  # the constant of loss_agg=seq_mean_token_sum_norm (None: the batch's width)
        self.reference: nn.Module | None = None  # the frozen reference policy of a KL penalty (jetflow.train.reference)
        self.dp = dp  # data-parallel ranks: each holds part of the batch (jetflow.distributed)
        if self.savers.checkpointing:  # recompute each decoder layer in backward
            enable_activation_checkpointing(model, train.release_host_memory)
        if train.max_tokens_per_micro_batch:  # exact packed gradients the padded ones' bits (jetflow.train.packing)
            use_packing_grid(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(weight_decay_groups(model, train.weight_decay), lr=train.lr,
                                           betas=tuple(train.betas))
        total = total_steps if total_steps is not None else train.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(train.warmup_steps, total, train.min_lr_ratio))
        self.version = 0  # optimizer steps applied: the weight version rollouts are tagged with
        self.base_sent = False  # LoRA: the frozen base went out with a weight update (later ones: adapters alone)
        self.skipped_steps = self.consecutive_bad = 0

    # Log-probs -----------------------------------------------------------------------------
    def _logprobs(self, mb: Experience, temperature: float = 1.0, model: nn.Module | None = None,
                  **kw) -> Tensor | tuple[Tensor, Tensor]:
        model = self.model if model is None else model
        return response_logprobs(model, mb, temperature, chunk_tokens=self.savers.chunk_tokens, **kw)

    @torch.no_grad()
    def compute_logprobs(self, exp: Experience, temperature: float = 1.0, reference: bool = False,
                         policy: nn.Module | None = None) -> Tensor:
        """Log-probs of the rollout tokens (no grad): (B, R), under the current weights, the frozen reference or
        `policy` (a copy of the policy under other weights: jetflow.run.staleness_split's), the same forward,
        sharded and pipelined alike; on a pipeline every stage gets them."""
        if reference and self.reference is None:
            raise ValueError("reference log-probs: this trainer keeps no reference policy")
        model = self.reference if reference else policy if policy is not None else self.model
        micro = micro_batches(exp, self.cfg, self.model)

        def logprobs() -> Tensor:
            if pipelined(model):
                return torch.cat(model.pipeline_forward_backward(
                    _stage_inputs(micro), lambda i, hidden: (None, self._logprobs(micro[i], temperature, model,
                                                                                    hidden=hidden)),
                    forward_only=True))
            return torch.cat([self._logprobs(mb, temperature, model) for mb in micro])

        out, bad = self._agreeing_on_nonfinite(logprobs)
        if bad:
            raise NonFiniteError("trainer log-probs: an FP8 quantizer met NaN or Inf on an expert-parallel rank; "
                                 "every rank stops here")
        return out

    def reference_bytes(self) -> int:  # what the reference policy holds in this process (jetflow.train.reference)
        return reference_nbytes(self.reference)

    def weight_update(self, mode: str, fingerprint: str | None, kv_scales: dict | None = None):
        """The payload for rollout engines at the current weight version (jetflow.sync). With LoRA adapters the
        first update carries the frozen base and the adapters, every later one the adapters alone."""
        from jetflow.sync import build_update
        lora = has_lora(self.model)
        update = build_update(self.model, mode, self.version, fingerprint, kv_scales=kv_scales,
                              base=not (lora and self.base_sent))
        drop_masters = getattr(self.model, "drop_frozen_masters", None)  # the Megatron policy's frozen base
        if lora and not self.base_sent and mode == "unified" and drop_masters is not None:
            drop_masters()  # its bytes alone from here on (the native base holds no master at all)
        self.base_sent = True
        return update

    # One optimizer step ----------------------------------------------------------------------
    def train_step(self, exp: Experience, temperature: float = 1.0) -> dict[str, float]:
        """Policy-gradient step over the whole batch (micro-batched) against exp.old_logprobs and
        exp.is_weights; returns metrics."""
        if exp.old_logprobs is None:
            raise ValueError("train_step needs exp.old_logprobs (compute_logprobs first)")
        metrics, _ = self._policy_step(exp, temperature)
        return metrics

    def train_step_on_policy(self, exp: Experience, temperature: float, correction: str,
                             correction_params: dict | None = None) -> tuple[dict[str, float], Tensor]:
        """The step when one update follows (algo.ppo_epochs = 1): pi_old is then the training forward's own
        log-probs, detached, so the separate no-grad forward of `compute_logprobs` is not needed. Under
        rollout.max_staleness > 0 the trainer is past the version that sampled, and pi_old is decoupled PPO's
        proximal policy (its current weights): the correction's weight pi_old / pi_rollout is then the staleness
        weight. The rollout correction's weights
        come from each micro-batch alone, so `correction` must be row-local (every mode but `ais`).

        Returns (metrics, old_logprobs (B, R)): the same numbers `compute_logprobs` gives, for the
        mismatch metrics."""
        if correction not in ROW_LOCAL:
            raise ValueError(f"correction {correction!r} needs batch-wide statistics; "
                             f"train_step_on_policy takes only {', '.join(ROW_LOCAL)}")

        def weigh(mb: Experience, old: Tensor) -> Tensor:
            return apply_correction(correction, mb.rollout_logprobs, old, mb.response_mask,
                                    **(correction_params or {})).weights
        return self._policy_step(exp, temperature, weigh)

    def _policy_step(self, exp: Experience, temperature: float, weigh=None) -> tuple[dict[str, float], Tensor | None]:
        """One optimizer step of the policy loss. Without `weigh`, pi_old and the correction weights are
        exp's; with it, pi_old is each micro-batch's detached log-probs and weigh(mb, old) gives its
        weights. Returns (metrics, old_logprobs (B, R) when weigh is given)."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        agg = loss_aggregation(self.algo)
        micro = micro_batches(exp, self.cfg, self.model)
        total_denominator = self.dp.sum(sum(agg_denominator(mb.response_mask, agg) for mb in micro)) or 1.0
        weights = [agg_denominator(mb.response_mask, agg) / total_denominator for mb in micro]
        (done, failed), bad = self._agreeing_on_nonfinite(lambda: self._forward_backward(
            micro, weights, lambda mb, hidden: self._micro_loss(mb, temperature, weigh, agg, hidden)))
        loss_total = float("nan") if failed or bad else sum(value for value, _ in done.values())
        sums: dict[str, float] = {}
        olds: list[Tensor] = []
        entropy_sum = tokens = 0.0
        for i, (mb, weight) in enumerate(zip(micro, weights)):
            shape, device = mb.response_ids.shape, mb.response_ids.device
            if i not in done:  # no response tokens (all masked: zeros), or after a NaN / Inf (see below)
                olds.append(torch.zeros(shape, device=device) if weight == 0 and not (failed or bad) else
                            torch.full(shape, float("nan"), device=device))
                continue
            _, (metrics, old, micro_entropy) = done[i]
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * weight
            if old is not None:
                olds.append(old if not bad else torch.full_like(old, float("nan")))
            entropy_sum += micro_entropy
            tokens += float(mb.response_mask.sum())
        # the policy's entropy per response token (nats): this rank's share of the mean over every
        # rank's tokens (the metrics are summed over ranks below)
        all_tokens = self.dp.sum(tokens)
        sums["policy/entropy"] = entropy_sum / all_tokens if all_tokens else 0.0
        return self._apply_gradients(loss_total, sums, t0), (torch.cat(olds) if weigh is not None else None)

    def _forward_backward(self, micro: list[Experience], weights: list[float],
                          loss_of: Callable[[Experience, Tensor | None], tuple[Tensor, Any]]
                          ) -> tuple[dict[int, tuple[float, Any]], bool]:
        """The one micro-batch loop of every optimizer step (the policy loss's and the warm-up's): each
        micro-batch's loss_of(mb, hidden) -> (loss, extra), times its weight, backpropagated, gradients
        accumulating. A micro-batch of weight 0 (no response tokens: nothing to learn) is skipped, unless the
        model's forward is a collective (the other ranks' token dispatch waits for it). A pipelined model runs
        them through its schedule (the loss computed on the last stage from the final hidden states `hidden`,
        as torchtitan's train step branches on its pipeline); any other one after the other (hidden None).

        Returns ({micro-batch index: (weighted loss value, extra)}, failed): failed when an FP8 quantizer met
        NaN / Inf (NonFiniteError), which skips the step like a NaN loss (train.max_bad_steps applies); the
        micro-batches done before it stay in the dict (a pipeline's: none)."""
        active = [i for i, w in enumerate(weights) if w != 0 or self.model.collective_forward]
        done: dict[int, tuple[float, Any]] = {}
        if pipelined(self.model):
            def head(j: int, hidden: Tensor):
                loss, extra = loss_of(micro[active[j]], hidden)
                weight = weights[active[j]]
                return loss * weight, (loss.item() * weight, extra)

            try:
                results = self.model.pipeline_forward_backward(_stage_inputs([micro[i] for i in active]), head)
            except NonFiniteError:  # on any stage: every stage skips the step
                return done, True
            return dict(zip(active, results)), False
        for i in active:
            try:
                loss, extra = loss_of(micro[i], None)
                (loss * weights[i]).backward()
            except NonFiniteError:  # forward or backward
                return done, True
            done[i] = (loss.item() * weights[i], extra)
        return done, False

    def _agreeing_on_nonfinite(self, compute: Callable[[], Any]) -> tuple[Any, bool]:
        """compute(), and whether an FP8 quantizer met NaN/Inf in it on any rank: (result, bad).
        A model whose forward runs collectives (expert parallelism: every MoE layer dispatches tokens to the
        other ranks' experts) cannot stop one rank at its first NaN, the others would wait for it in the next
        dispatch forever: compute runs with the error deferred (the NaN flows on), then every rank learns
        whether any met one. Other models raise NonFiniteError where it happens, and bad is False."""
        if not self.model.collective_forward:
            return compute(), False
        with defer_nonfinite() as record:
            result = compute()
        return result, self.dp.any_in_world(record.message is not None)

    def _micro_loss(self, mb: Experience, temperature: float, weigh, agg: str, hidden: Tensor | None = None
                    ) -> tuple[Tensor, tuple[dict[str, float], Tensor | None, float]]:
        """The policy loss of one micro-batch (unweighted) and (its metrics, its pi_old when `weigh` is given
        (else None), its entropy sum over response tokens). `hidden`: see `response_logprobs`."""
        logprobs, entropy = self._logprobs(mb, temperature, with_entropy=True, hidden=hidden)  # (b, R) each
        if weigh is None:
            old, is_weights, new_old = mb.old_logprobs, mb.is_weights, None
        else:
            old = new_old = logprobs.detach()
            is_weights = weigh(mb, old)
        loss, metrics = policy_loss(logprobs, old, mb.advantages, mb.response_mask,
                                    clip_low=self.algo.clip_low, clip_high=self.algo.clip_high, agg=agg,
                                    is_weights=is_weights, ref_logprobs=mb.ref_logprobs,
                                    kl_coef=self.algo.kl_coef if self.algo.kl_in == "loss" else 0.0,
                                    kl_estimator=self.algo.kl_estimator, ratio_level=self.algo.ratio_level,
                                    scale=self.loss_scale)
        if self.algo.router_aux_loss_coef:  # MoE: the router load-balancing loss of this forward
            aux = self.model.load_balancing_loss()
            if aux is not None:
                loss = loss + self.algo.router_aux_loss_coef * aux
                metrics["loss/router_aux"] = float(aux.detach())
        if mb.routed_experts is not None and (flips := replay_flip_fraction(self.model)) is not None:
            metrics["moe/router_flip_frac"] = flips  # rollout and trainer routers disagreeing
        return loss, (metrics, new_old, float((entropy * mb.response_mask).sum()))

    def sft_step(self, exp: Experience) -> dict[str, float]:
        """Supervised step: mean negative log-likelihood of the response tokens (every micro-batch's loss is
        already divided by the batch's token count: weight 1)."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        micro = micro_batches(exp, self.cfg, self.model)
        total_tokens = self.dp.sum(float(exp.response_mask.sum())) or 1.0

        def nll(mb: Experience, hidden: Tensor | None) -> tuple[Tensor, None]:
            return -(self._logprobs(mb, hidden=hidden) * mb.response_mask).sum() / total_tokens, None

        (done, failed), bad = self._agreeing_on_nonfinite(
            lambda: self._forward_backward(micro, [1.0] * len(micro), nll))
        loss_total = float("nan") if failed or bad else sum(value for value, _ in done.values())
        return self._apply_gradients(loss_total, {}, t0, sft=True)

    def _apply_gradients(self, loss_value: float, metrics: dict[str, float], t0: float,
                         sft: bool = False) -> dict[str, float]:
        # Each rank holds its share of the global-batch loss and gradient: sum both over ranks.
        self.model.reduce_data_parallel_grads(self.dp)  # a sharded policy: each parameter over its own group
        summed = self.dp.sum_dict({**metrics, "_loss": loss_value})
        loss_value = summed.pop("_loss")
        metrics = {"loss/sft": loss_value} if sft else summed
        max_norm = self.cfg.grad_clip or float("inf")
        grad_norm = self.model.clip_grad_norm_(max_norm)  # a sharded policy: the norm over all its shards
        finite = math.isfinite(loss_value) and bool(torch.isfinite(grad_norm))
        out = dict(metrics)
        out.update({"train/loss": loss_value, "train/grad_norm": float(grad_norm),
                    "train/lr": self.optimizer.param_groups[0]["lr"]})
        if finite:
            self.optimizer.step()
            self.version += 1
            self.consecutive_bad = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive_bad += 1
            if self.consecutive_bad > self.cfg.max_bad_steps:
                raise TrainingDiverged(
                    f"{self.consecutive_bad} consecutive steps with a NaN/Inf loss or gradient "
                    f"(train.max_bad_steps={self.cfg.max_bad_steps}); stopping. The last good checkpoint is intact.")
        with warnings.catch_warnings():  # a skipped step still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
            self.scheduler.step()
        out["train/skipped"] = 0.0 if finite else 1.0
        out["train/skipped_total"] = float(self.skipped_steps)
        out["time/train"] = time.perf_counter() - t0
        return out

    # State -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "version": self.version, "skipped_steps": self.skipped_steps,
                "consecutive_bad": self.consecutive_bad}

    def load_state_dict(self, state: dict) -> None:
        """Restore optimizer moments, schedule position and counters. The hyperparameters are this
        trainer's config (the same as the checkpoint's unless a resume allowed them to change).
        `optimizer: None`: the moments were loaded already (the FSDP backend's sharded state)."""
        optimizer = state["optimizer"]
        if optimizer is not None:
            if len(optimizer["param_groups"]) == 1 < len(self.optimizer.param_groups):
                optimizer = self._regrouped(optimizer)  # saved before the weight-decay groups
            self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = [self.cfg.lr for _ in self.optimizer.param_groups]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group.update(lr=self.cfg.lr * factor, initial_lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                         weight_decay=self.cfg.weight_decay if group["decay"] else 0.0)
        self.version = state["version"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_bad = state["consecutive_bad"]

    def _regrouped(self, saved: dict) -> dict:
        """An optimizer state saved with one parameter group (every parameter, in `self.params` order),
        laid out in this optimizer's groups: each parameter keeps its moments."""
        index = {id(p): i for i, p in enumerate(self.params)}
        state, groups, j = {}, [], 0
        for group in self.optimizer.param_groups:
            ids = []
            for p in group["params"]:
                if index[id(p)] in saved["state"]:
                    state[j] = saved["state"][index[id(p)]]
                ids.append(j)
                j += 1
            groups.append({**saved["param_groups"][0], "params": ids, "decay": group["decay"]})
        return {"state": state, "param_groups": groups}
