"""The two sides of a run as one process holds them: the trainer side (task, tokenizer, policy model
under the precision mode, optimizer, FP8 KV quantizer) and the rollout engine built beside it (or
alone, in a Ray rollout actor)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

from jetflow.config import Config, Derived, conversation_tokens
from jetflow.distributed import SINGLE, DataParallel
from jetflow.rollout.conversation import conversation_driver
from jetflow.rollout.native import NativeRollout
from jetflow.run.ahead import RolloutsAhead
from jetflow.run.engine_process import ProcessRollout, thread_split
from jetflow.run.build import (RunInputs, attach_kv_fp8, build_model, copy_model, load_inputs, loads_whole_policy,
                               lora_adapter_config, rollout_model, stop_token_ids)
from jetflow.run.files import engine_dir as run_engine_dir
from jetflow.run.inflight import swap_step
from jetflow.run.loop import RLLoop
from jetflow.run.megatron_side import (build_trainer_model, gather_trainer_state, model_data_parallel,
                                       select_trainer_state)
from jetflow.run.vllm_side import build_vllm_rollout
from jetflow.run.warmup import Warmup
from jetflow.model import CheckpointError
from jetflow.model.protocol import adapter_weights, lora_base_digest
from jetflow.train.checkpoint import (CHECKPOINTS_DIR, LORA_BASE, check_lora_base, checkpoint_name, checkpoint_weights,
                                      load_checkpoint, save_checkpoint)
from jetflow.train.reference import freeze_reference
from jetflow.train.trainer import Trainer


def sharded_optimizer(model) -> bool:
    """The FSDP backend: each rank holds its shards of the optimizer state (checkpointed with DCP,
    jetflow.train.fsdp.state)."""
    from jetflow.train.fsdp import FSDPPolicy  # torch's FSDP2, imported where the backend is asked about

    return isinstance(model, FSDPPolicy)


IN_FLIGHT = "rollouts_in_flight"  # the trainer state's entry of the batches generated ahead


class TrainerSide:
    """The trainer half of a run: task, tokenizer, policy model under the precision mode, optimizer,
    optional FP8 KV quantizer. One per process (or per data-parallel rank / Ray trainer worker)."""

    def __init__(self, cfg: Config, derived: Derived, inputs: RunInputs, dp: DataParallel = SINGLE):
        torch.manual_seed(cfg.run.seed)  # the run's RNG streams start here, wherever the side is placed
        random.seed(cfg.run.seed)
        self.cfg, self.derived, self.inputs = cfg, derived, inputs
        self.task, self.tokenizer = inputs.task, inputs.tokenizer
        # an FSDP rank other than 0 builds a weightless shell, filled from rank 0 unit by unit as it is sharded
        whole = loads_whole_policy(cfg, dp.global_rank)
        model = build_model(cfg, inputs.arch, self.tokenizer, weights=whole)
        self.encode = inputs.encode
        kv = derived.precision.kv_quantizer("trainer", inputs.arch.num_layers)  # FP8 K/V (precision.kv_cache_fp8)
        # the Decoder under the mode, or a MegatronPolicy of it; the K/V quantizer the run drives (or None)
        self.model, self.kv_quantizer = build_trainer_model(cfg, derived, model, kv)
        self.dp = model_data_parallel(self.model, dp)  # under tensor parallelism: Megatron's DP group
        if cfg.train.backend == "fsdp":
            from jetflow.train.fsdp.from_rank0 import share_rng_state
            share_rng_state(cfg.model.device)  # every rank's RNG where rank 0's build (a tiny model's init) left it
        self.trainer = Trainer(self.model, cfg.train, cfg.algo, dp=self.dp,
                               loss_scale=cfg.algo.loss_scale_factor or cfg.rollout.max_new_tokens,
                               savers=derived.savers)  # `auto` resolved by the memory estimate
        self.warmup: Warmup | None = None  # while the supervised warm-up runs
        self.restored_in_flight: dict | None = None  # the checkpoint's batches generated ahead (jetflow.run.ahead)
        self.lora_base: str | None = None  # the frozen LoRA base's sha256, once computed

    def state(self) -> dict:
        state = self.trainer.state_dict()
        if self.kv_quantizer is not None:
            state["kv_quantizer"] = self.kv_quantizer.state_dict()
        if self.warmup is not None:  # in the middle of the warm-up: its optimizer and schedule
            state["warmup"] = self.warmup.state_dict()
        return state

    def restore(self, checkpoint: Path) -> dict:
        """Load a checkpoint into model, optimizer and KV quantizer (and, in the middle of the warm-up,
        the warm-up's optimizer); returns its state (next_step, sft_done[, warmup_step])."""
        saved, state = load_checkpoint(checkpoint, self.model)
        saved = select_trainer_state(self.model, saved)
        self.restored_in_flight = saved.pop(IN_FLIGHT, None)  # rollout.max_staleness > 0: batches generated ahead
        trained_on = saved.pop(LORA_BASE, None)
        if trained_on is not None:
            check_lora_base(checkpoint, trained_on, self._base_digest(), self.cfg.model.path)
        if sharded_optimizer(self.model):  # FSDP: the moments from the checkpoint's DCP shards, resharded
            from jetflow.train.fsdp.state import load_optimizers
            load_optimizers(self.model, self._optimizers(warmup="warmup" in saved), checkpoint)
        elif saved["optimizer"] is None:
            raise CheckpointError(f"{checkpoint} was written by train.backend=fsdp (sharded optimizer state): resume "
                                  "it with train.backend=fsdp")
        self.trainer.load_state_dict(saved)
        if self.kv_quantizer is not None and "kv_quantizer" in saved:
            self.kv_quantizer.load_state_dict(saved["kv_quantizer"])
        if "warmup" in saved:
            self._warmup().load_state_dict(saved["warmup"])
        return state

    def save(self, run_dir: Path, step: int, sft_done: bool, warmup_step: int | None = None,
             in_flight: dict | None = None) -> None:
        """A checkpoint at RL step `step`, or at warm-up step `warmup_step` in the middle of the warm-up,
        unless the last steps were skipped as non-finite: then the last good checkpoint stays the newest
        (a resume goes back to it). `in_flight`: the batches generated ahead for steps >= `step`."""
        trainer = self.warmup.trainer if warmup_step is not None and self.warmup is not None else self.trainer
        if trainer.consecutive_bad:  # the same on every rank: losses and gradients are summed
            if self.dp.is_main:
                where = f"warm-up step {warmup_step}" if warmup_step is not None else f"step {step}"
                print(f"[jetflow] warning: no checkpoint at {where}: the last {trainer.consecutive_bad} "
                      "step(s) were skipped as non-finite; the last good checkpoint stays", file=sys.stderr)
            return
        if sft_done:
            self.warmup = None  # done: its optimizer state is not needed any more
        lora = self.cfg.model.lora.rank > 0  # the adapters alone (a PEFT directory): the base is rebuilt on resume
        weights = adapter_weights(self.model) if lora else checkpoint_weights(self.model)  # TP: a collective
        trainer_state = gather_trainer_state(self.model, self.state())
        if in_flight:
            trainer_state[IN_FLIGHT] = in_flight
        if lora and trainer_state is not None:  # what the adapters were trained on: a resume compares the base it
            trainer_state[LORA_BASE] = self._base_digest()  # rebuilds (None: a model part's rank > 0, rank 0 writes)
        state = {"next_step": step, "sft_done": sft_done, **({} if warmup_step is None else {"warmup_step": warmup_step})}
        name, extra = checkpoint_name(step, warmup_step), {}
        if sharded_optimizer(self.model):  # FSDP: every rank writes its optimizer shards (DCP), rank 0 the rest
            from jetflow.train.fsdp.state import OPTIMIZER_DIR, save_optimizers, without_optimizers
            staging = run_dir / CHECKPOINTS_DIR / f".dcp-{name}"
            save_optimizers(self.model, self._optimizers(warmup=self.warmup is not None), staging, self.dp.global_rank)
            self.dp.barrier()
            trainer_state, extra = without_optimizers(trainer_state), {OPTIMIZER_DIR: staging}
        if self.dp.is_main:
            save_checkpoint(run_dir, step, self.model, trainer_state, state, model_state=weights, hf_config=not lora,
                            tokenizer=self.tokenizer, name=name, extra_dirs=extra,  # self-describing
                            adapter_config=lora_adapter_config(self.cfg, self.model) if lora else None)
        self.dp.barrier()

    def _base_digest(self) -> str:
        """The frozen LoRA base's sha256 (jetflow.precision.lora.base_digest), computed once: it does not change."""
        if self.lora_base is None:
            self.lora_base = lora_base_digest(self.model)  # a sharded policy's: its native base's
        return self.lora_base

    def _optimizers(self, warmup: bool) -> dict:
        """The optimizers whose state a checkpoint holds: the trainer's, and the warm-up's in its middle."""
        return {"trainer": self.trainer.optimizer, **({"warmup": self._warmup().trainer.optimizer} if warmup else {})}

    def _warmup(self) -> Warmup:
        if self.warmup is None:
            self.warmup = Warmup(self.cfg, self.model, self.task, self.encode, self.tokenizer, self.dp,
                                 self.derived.savers)
        return self.warmup

    def warmup_step(self, step: int) -> dict:
        """Supervised warm-up step `step`; returns its metrics."""
        return self._warmup().step(step)

    def keep_reference(self, run_dir: Path | None) -> None:
        """The frozen reference policy of a KL penalty (algo.kl_coef > 0 or algo.log_ref_kl), built once
        when RL begins (this process's part of it, under model parallelism)."""
        if (self.cfg.algo.kl_coef or self.cfg.algo.log_ref_kl) and self.trainer.reference is None:
            self.trainer.reference = build_reference(self.cfg, self.derived, self.model, run_dir, self.dp)

    def rl_loop(self, run_dir: Path | None = None) -> RLLoop:
        """The RL loop of this process: this side's trainer and a rollout engine beside it (a vLLM engine
        starts from a checkpoint in `run_dir`), or under rollout.max_staleness > 0 in a process of its own,
        the threads split between the two (jetflow.run.engine_process)."""
        self.keep_reference(run_dir)
        cfg, ahead = self.cfg, None
        if cfg.rollout.max_staleness:
            trainer_threads, engine_threads = thread_split(cfg)
            rollout = ProcessRollout(standalone_engine, cfg, self.derived, engine_threads)
            torch.set_num_threads(trainer_threads)
            ahead = RolloutsAhead(rollout, cfg.rollout.max_staleness, cfg.train.steps, self.restored_in_flight,
                                  swap_step(cfg))
        else:
            rollout = build_rollout_side(cfg, self.derived, self.inputs, self, run_dir, self.dp)
        return RLLoop(cfg, self.derived, self.trainer, rollout, self.task, self.encode,
                      self.tokenizer.pad_token_id, self.kv_quantizer, self.dp, ahead)


REFERENCE_FILE = "reference.pt"


def build_reference(cfg: Config, derived: Derived, model, run_dir: Path | None, dp: DataParallel = SINGLE):
    """The frozen reference policy (jetflow.train.reference): the policy's weights when RL begins, after
    any supervised warm-up. They are kept in the run directory (reference.pt, written once, HF-named and
    whole whichever backend wrote it), so that a run resumed in the middle of RL gets the same reference
    back and not its current weights. On the Megatron backend the reference is a MegatronPolicy of the
    policy's layout, on the FSDP backend an FSDPPolicy of its sharding: each rank keeps its own shard,
    and its forward is the policy's."""
    cuda = [torch.cuda.current_device()] if torch.device(cfg.model.device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # the copies' init and MegatronPolicy draw: the run's RNG goes on
        return _frozen_reference(cfg, derived, model, None if run_dir is None else Path(run_dir) / REFERENCE_FILE, dp)


def _frozen_reference(cfg: Config, derived: Derived, model, path: Path | None, dp: DataParallel):
    reference = copy_model(model)  # this process's current weights (gathered under TP / PP / EP: a collective)
    if path is not None and path.is_file():
        reference.load_state_dict(torch.load(path, map_location=cfg.model.device, weights_only=True), strict=False)
    elif path is not None and dp.is_main:
        tmp = path.with_name(path.name + ".tmp")
        torch.save(reference.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: a resume never reads half a file
    return freeze_reference(build_trainer_model(cfg, derived, reference)[0])  # the policy's precision and sharding


def engine_max_seq_len(cfg: Config, longest_prompt: int) -> int:
    """Positions the rollout engine makes room for in a request of one turn: twice the longest prompt, the
    response and 16 (a margin). The native engine's default page pool is sized by it (jetflow.rollout.native
    .kv_pool_bytes), and so is the memory estimate's (jetflow.run.memory_estimate)."""
    return 2 * longest_prompt + cfg.rollout.max_new_tokens + 16


def standalone_engine(cfg: Config, derived: Derived):
    """A rollout engine alone in its process (the engine's process beside the trainer: jetflow.run.engine_process),
    built from the run's inputs as that process reads them."""
    return build_rollout_side(cfg, derived, load_inputs(cfg))


def build_rollout_side(cfg: Config, derived: Derived, inputs: RunInputs, side: TrainerSide | None = None,
                       run_dir: Path | None = None, dp: DataParallel = SINGLE, engine_dir: Path | None = None):
    """The rollout engine of a run. Beside a trainer (`side`) it starts from a copy of the trainer's
    model; alone (a Ray rollout actor) it builds its own, whose weights the first sync replaces.
    A vLLM engine starts from a checkpoint written to `engine_dir` (default: in the run directory)."""
    task, tokenizer = inputs.task, inputs.tokenizer
    source = side.model if side is not None else build_model(cfg, inputs.arch, tokenizer)
    max_seq_len = engine_max_seq_len(cfg, inputs.longest_prompt)
    driver = conversation_driver(cfg, task, tokenizer)  # multi-turn (rollout.max_turns > 1), else None
    if driver is not None:  # a conversation's budget: its prompt, turns and observations
        max_seq_len = conversation_tokens(cfg.rollout, inputs.longest_prompt)
    eos = stop_token_ids(tokenizer, source, task)
    if cfg.rollout.backend == "vllm":  # an engine started from the trainer's current weights
        engine_dir = engine_dir or run_engine_dir(run_dir, "local", dp.global_rank)
        model = source if cfg.model.lora.rank else copy_model(source)  # LoRA: read only, the policy is blank
        return build_vllm_rollout(cfg, derived, model, tokenizer, eos, task.stop, max_seq_len, engine_dir, driver=driver)
    model = rollout_model(cfg, derived.precision, source)  # with LoRA: blank, the first update fills it
    attach_kv_fp8(model, derived.precision, "rollout")
    return NativeRollout(model, cfg, tokenizer, eos, task.stop, max_seq_len=max_seq_len,
                         fingerprint=derived.precision.fingerprint, driver=driver)
