"""`run.orchestrator=ray`: rollout engines and trainer workers as Ray actors.

    driver (this process)          RLLoop: prompts, rewards, advantages, metrics, logs, checkpoints
    TrainerWorker x train.num_workers   a Trainer each, data parallel over gloo (NCCL on GPUs); with
                                        train.backend=megatron, model-parallel groups of
                                        tensor_parallel_size x pipeline_parallel_size workers (same
                                        rows; weight shards, pipeline stages); with
                                        train.backend=fsdp, the ranks of one FSDP (or HSDP) group;
                                        worker 0 builds the weight update and puts it in the object store
    RolloutWorker x rollout.num_engines a rollout engine: native, or vLLM (rollout.backend=vllm) started
                                        from a checkpoint of its own under the run directory

Weights move once per step: worker 0 puts its `WeightUpdate` (under `unified` the FP8 bytes + scales
it trains with) into the object store with a checksum; every rollout actor fetches it and verifies
version, recipe fingerprint, checksum and scales before loading (jetflow.sync.apply_update).

Fault tolerance: rollout actors restart on failure (`max_restarts`); the driver's RayRollout
(jetflow.run.ray_rollout) re-issues what a dead actor lost. Asynchronous rollouts (rollout.max_staleness > 0):
the driver's RolloutsAhead (jetflow.run.ahead) queues batches on the engine actors while the trainer workers
train, as it does on the engine process of a local run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from jetflow.config import Config, Derived, from_dict, to_dict
from jetflow.distributed import free_port
from jetflow.errors import MissingDependencyError
from jetflow.rl.experience import Experience
from jetflow.rollout.types import Rollouts
from jetflow.run.build import RunInputs, load_inputs
from jetflow.run.ahead import RolloutsAhead
from jetflow.run.files import engine_dir
from jetflow.run.loop import RLLoop
from jetflow.run.ray_rollout import ACTOR_RESTARTS, RayRollout, RemoteUpdate
from jetflow.run.stop import RESUME_HINT, RunFault
from jetflow.sync import WeightUpdate

# The Trainer methods (jetflow.train.protocol.PolicyTrainer) the driver's TrainerGroup runs on every worker's
# rows of a batch, by name through `TrainerWorker.call`. (weight_update runs on every worker with the same
# arguments and leaves its result in the object store; reference_bytes is known on the driver.)
ROW_CALLS = ("compute_logprobs", "train_step", "train_step_on_policy")


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError("run.orchestrator=ray needs Ray: pip install -e '.[ray]' (ray==2.60.0)") from e
    return ray


# Actors (plain classes; made remote in `_actor_classes` so that importing this module needs no Ray).

class RolloutWorker:
    """One rollout engine replica: jetflow's native engine over its own model copy."""

    def __init__(self, cfg_dict: dict, derived: Derived, num_threads: int, engine_dir: str):
        torch.set_num_threads(num_threads)
        from jetflow.run.sides import build_rollout_side
        cfg = from_dict(cfg_dict)  # the actor reads the run's inputs itself (its node's files)
        self.rollout = build_rollout_side(cfg, derived, load_inputs(cfg), engine_dir=Path(engine_dir))
        self._free_since, self._idle_s = time.perf_counter(), 0.0  # idle: between the end of a call and the next

    def _starting(self) -> float:
        now = time.perf_counter()
        self._idle_s += now - self._free_since
        return now

    def load_weights(self, update: WeightUpdate, rewind: bool = False) -> int:
        """Verifies version, fingerprint, checksum and scales. `rewind`: any version, also an older one (a
        restarted actor regenerating a stale batch, jetflow.run.ray_rollout); the update holds the whole model."""
        self._starting()
        if rewind:
            self.rollout.weight_version = -1
        self.rollout.load_weights(update)
        self._free_since = time.perf_counter()
        return self.rollout.weight_version

    def generate(self, prompts: list[list[int]], seeds: list[int], greedy: bool = False) -> Rollouts:
        return self.rollout.generate(prompts, seeds, greedy)

    def generate_timed(self, prompts: list[list[int]], seeds: list[int],
                       greedy: bool = False) -> tuple[Rollouts, float, float, int]:
        """`generate`, with its seconds, this actor's idle seconds since the last reply, and its process id."""
        t0 = self._starting()
        out = self.rollout.generate(prompts, seeds, greedy)
        self._free_since = time.perf_counter()
        idle, self._idle_s = self._idle_s, 0.0
        return out, self._free_since - t0, idle, os.getpid()

    def pid(self) -> int:
        return os.getpid()


class TrainerWorker:
    """One data-parallel rank of the trainer (rank 0 also builds weight updates and checkpoints).

    Built in two calls, because joining the process group blocks until every rank joins: the
    constructor, then `setup` with the address rank 0 listens on (`rendezvous_address`, asked of rank 0
    on whatever node Ray placed it)."""

    def __init__(self, cfg_dict: dict, derived: Derived, rank: int, world_size: int, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.cfg_dict, self.derived, self.rank, self.world_size = cfg_dict, derived, rank, world_size

    def rendezvous_address(self) -> tuple[str, int]:
        return import_ray().util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": master_addr,
                           "MASTER_PORT": str(master_port), "LOCAL_RANK": "0"})
        from jetflow.distributed import SINGLE, init_from_env
        from jetflow.run.sides import TrainerSide
        cfg = from_dict(self.cfg_dict)
        self.dp = init_from_env(cfg.model.device) if self.world_size > 1 else SINGLE
        self.side = TrainerSide(cfg, self.derived, load_inputs(cfg), self.dp)  # the inputs: its node's files

    def warmup_step(self, step: int) -> dict:
        return self.side.warmup_step(step)

    def restore(self, checkpoint: str) -> dict:
        return self.side.restore(Path(checkpoint))

    def save_checkpoint(self, run_dir: str, step: int, sft_done: bool, warmup_step: int | None = None,
                        in_flight: dict | None = None) -> None:
        self.side.save(Path(run_dir), step, sft_done, warmup_step, in_flight)

    def restored_in_flight(self) -> dict | None:
        """The batches generated ahead that the checkpoint restored last kept (jetflow.run.ahead)."""
        return self.side.restored_in_flight

    def keep_reference(self, run_dir: str) -> int:
        """This worker's part of the reference policy (a KL penalty); returns the bytes it holds."""
        self.side.keep_reference(Path(run_dir))
        return self.side.trainer.reference_bytes()

    def call(self, method: str, exp: Experience, *args) -> tuple[Any, int]:
        """This worker's Trainer's `method` (one of ROW_CALLS) on its rows `exp`: (the result, the trainer's
        weight version after it)."""
        if method not in ROW_CALLS:
            raise ValueError(f"TrainerWorker.call: {method!r} is not one of {ROW_CALLS}")
        trainer = self.side.trainer
        return getattr(trainer, method)(exp, *args), trainer.version

    def weight_update(self, mode: str, fingerprint: str | None, kv_scales: dict | None = None):
        """Build the update; rank 0 puts it in the object store and returns (ref, bytes), so the driver
        never copies the weights itself. Every worker is called: a tensor-parallel model gathers its
        shards collectively. The others return (None, 0)."""
        ray = import_ray()
        from jetflow.sync import build_update
        update = build_update(self.side.model, mode, self.side.trainer.version, fingerprint, with_checksum=True,
                              kv_scales=kv_scales)
        return (ray.put(update), update.nbytes()) if self.rank == 0 else (None, 0)

    # The FP8 KV quantizer of this worker's model (precision.kv_cache_fp8), driven by RemoteKVQuantizer.
    def kv_calibrated(self) -> bool:
        return self.side.kv_quantizer.calibrated

    def kv_set_calibrating(self, on: bool) -> None:
        self.side.kv_quantizer.calibrating = on

    def kv_recalibrate(self) -> dict:
        return self.side.kv_quantizer.recalibrate(self.side.dp)

    def info(self) -> dict:
        t = self.side.trainer
        return {"version": t.version, "skipped_steps": t.skipped_steps, "num_params": self.side.model.num_params(),
                "dp_rank": self.side.dp.rank, "dp_size": self.side.dp.world_size}


def gpus_per_actor(device: str, num_trainers: int, num_engines: int, cluster_gpus: float) -> float:
    """The GPU share each actor asks Ray for. On CUDA every actor needs one: Ray hides the GPUs
    (CUDA_VISIBLE_DEVICES="") from an actor that asks for none. A whole GPU each when the cluster
    has that many; with one trainer worker and fewer GPUs, equal shares, so the rollout engines
    colocate with it. Several trainer workers must not share a GPU (NCCL refuses two ranks on one
    device), and fractional shares cannot promise that, so that case is refused."""
    if not device.startswith("cuda"):
        return 0
    actors = num_trainers + num_engines
    if cluster_gpus >= actors:
        return 1.0
    if num_trainers == 1 and cluster_gpus > 0:
        return cluster_gpus / actors
    raise RuntimeError(f"model.device={device!r}: {num_trainers} trainer workers and {num_engines} rollout engines "
                       f"need {actors} GPUs, the Ray cluster has {cluster_gpus:g} (with fewer GPUs, use one trainer "
                       "worker: the engines then share its GPUs)")


def _actor_classes(ray, num_gpus: float = 0):
    rollout = ray.remote(num_cpus=0, num_gpus=num_gpus, max_restarts=ACTOR_RESTARTS, max_task_retries=0)(RolloutWorker)
    trainer = ray.remote(num_cpus=0, num_gpus=num_gpus)(TrainerWorker)
    return rollout, trainer


def trainer_results(ray, futures: list, doing: str) -> list:
    """ray.get of the trainer workers' calls; a worker that died (trainer workers are not restarted:
    their process group would have to be rebuilt) ends the run with RunFault naming it."""
    try:
        return ray.get(futures)
    except ray.exceptions.OutOfMemoryError as e:  # Ray's memory monitor killed it (not a RayActorError)
        raise RunFault(f"Ray killed a trainer worker for memory {doing} ({_first_line(e)[:160]}); the memory savers' "
                       "`auto` is not resolved under Ray: set train.activation_checkpointing=true and "
                       "train.logprob_chunk_tokens=512 (or fewer tokens a step); its checkpoints are intact: "
                       f"{RESUME_HINT}") from e
    except ray.exceptions.RayActorError as e:
        raise RunFault(f"a Ray trainer worker died {doing} ({_first_line(e)}); its checkpoints are intact: "
                       f"{RESUME_HINT}") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# Driver-side proxies the RLLoop talks to.

class TrainerGroup:
    """The loop's trainer (a jetflow.train.protocol.PolicyTrainer): splits each batch row-wise over the
    data-parallel ranks (whole GRPO groups each). `dp_ranks[i]` is worker i's data-parallel rank: the
    workers of one model-parallel group (Megatron) share a rank and get the same rows."""

    def __init__(self, ray, workers: list, cfg: Config, dp_ranks: list[int]):
        self.ray, self.workers, self.cfg, self.dp_ranks = ray, workers, cfg, dp_ranks
        self.dp_size = max(dp_ranks) + 1
        self.version = 0
        self.skipped_steps = 0
        self.reference_size = 0

    def _shards(self, exp: Experience) -> list[Experience]:
        """Worker i's rows: its data-parallel rank's share of the batch. (Advantages are computed on the
        driver and the loss denominators are global, so a shard need not hold whole GRPO groups.)"""
        n = exp.batch_size
        if n % self.dp_size:
            raise ValueError(f"{n} sequences do not split evenly over {self.dp_size} data-parallel ranks")
        per = n // self.dp_size
        return [exp.select(slice(r * per, (r + 1) * per)) for r in self.dp_ranks]

    def _rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Per-row results of every worker -> the batch's, one worker per data-parallel rank, in order."""
        first: dict[int, torch.Tensor] = {}
        for r, part in zip(self.dp_ranks, parts):
            first.setdefault(r, part)
        return torch.cat([first[r] for r in range(self.dp_size)])

    def _on_rows(self, method: str, exp: Experience, *args) -> list:
        """Every worker's Trainer's `method` (one of ROW_CALLS) on its rows of `exp`: the results, in worker
        order. The trainer's weight version is worker 0's after the call."""
        calls = [w.call.remote(method, s, *args) for w, s in zip(self.workers, self._shards(exp))]
        results = trainer_results(self.ray, calls, "during an RL step")
        self.version = results[0][1]
        return [result for result, _ in results]

    def compute_logprobs(self, exp: Experience, temperature: float = 1.0, reference: bool = False,
                         policy: Any = None) -> torch.Tensor:
        if policy is not None:
            raise ValueError("Ray trainer workers compute log-probs under their own weights only")
        return self._rows(self._on_rows("compute_logprobs", exp, temperature, reference))

    def reference_bytes(self) -> int:
        return self.reference_size  # worker 0's part, measured when RayPlacement.build_loop built it

    def train_step(self, exp: Experience, temperature: float = 1.0) -> dict[str, float]:
        return self._stepped(self._on_rows("train_step", exp, temperature)[0])

    def _stepped(self, metrics: dict[str, float]) -> dict[str, float]:
        """Record a step's outcome; train metrics are summed over ranks already, identical on all."""
        self.skipped_steps = int(metrics.get("train/skipped_total", self.skipped_steps))
        return metrics

    def train_step_on_policy(self, exp: Experience, temperature: float, correction: str,
                             correction_params: dict) -> tuple[dict[str, float], torch.Tensor]:
        results = self._on_rows("train_step_on_policy", exp, temperature, correction, correction_params)
        return self._stepped(results[0][0]), self._rows([old for _, old in results])

    def weight_update(self, mode: str, fingerprint: str | None, kv_scales=None) -> RemoteUpdate:
        ref, size = trainer_results(self.ray, [w.weight_update.remote(mode, fingerprint, kv_scales)
                                               for w in self.workers], "during a weight update")[0]
        return RemoteUpdate(ref, self.version, size)


class RemoteKVQuantizer:
    """The loop's `kv_quantizer` under Ray (a jetflow.train.protocol.KVCalibration): the trainer workers'
    FP8 KV quantizers, driven together. Each worker observes K/V amax in its own forwards; `recalibrate`
    max-reduces it over the workers' data-parallel group and every worker sets the same scales (worker
    0's are returned)."""

    def __init__(self, ray, workers: list):
        self.ray, self.workers = ray, workers

    @property
    def calibrated(self) -> bool:
        return self.ray.get(self.workers[0].kv_calibrated.remote())

    def _set_calibrating(self, on: bool) -> None:
        self.ray.get([w.kv_set_calibrating.remote(on) for w in self.workers])

    calibrating = property(fset=_set_calibrating, doc="Set on every worker: observe K/V amax in the next forwards.")

    def recalibrate(self, dp=None) -> dict:
        """`dp` is the driver's (a single process): the reduction runs among the workers."""
        return self.ray.get([w.kv_recalibrate.remote() for w in self.workers])[0]


class RayPlacement:
    """The run's trainer workers and rollout engines as Ray actors; the driver (this process) runs the
    sequence and the loop. A context manager: leaving it kills the actors (and stops a Ray it started)."""
    is_main = True
    barrier = staticmethod(lambda: None)  # the workers meet at their own barriers (in `save`)

    def __init__(self, cfg: Config, derived: Derived, inputs: RunInputs, run_dir: Path):
        self.cfg, self.derived, self.inputs, self.run_dir = cfg, derived, inputs, run_dir
        self.ray = ray = import_ray()
        self.started_here = not ray.is_initialized()
        if self.started_here:
            # Actors share nodes with each other: OpenMP threads that spin while idle would steal their cores.
            runtime_env = {"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}}
            if cfg.run.ray_address:
                ray.init(address=cfg.run.ray_address, runtime_env=runtime_env)
            else:
                ray.init(num_cpus=cfg.run.ray_num_cpus or os.cpu_count(), include_dashboard=False,
                         log_to_driver=True, runtime_env=runtime_env)
        w = self.data_parallel_size = cfg.train.num_workers
        gpus = gpus_per_actor(cfg.model.device, w, cfg.rollout.num_engines, ray.cluster_resources().get("GPU", 0))
        rollout_cls, trainer_cls = _actor_classes(ray, gpus)
        cfg_dict = to_dict(cfg)
        threads = max(1, cfg.run.num_threads or 1)
        self.workers = workers = [trainer_cls.remote(cfg_dict, derived, r, w, threads) for r in range(w)]
        master_addr, master_port = ray.get(workers[0].rendezvous_address.remote())
        ray.get([wk.setup.remote(master_addr, master_port) for wk in workers])
        engine_threads = cfg.rollout.engine_threads or threads
        self.engines = [rollout_cls.remote(cfg_dict, derived, engine_threads, str(engine_dir(run_dir, "ray", i)))
                        for i in range(cfg.rollout.num_engines)]
        infos = ray.get([wk.info.remote() for wk in workers])
        self.trainer = TrainerGroup(ray, workers, cfg, [i["dp_rank"] for i in infos])
        self.rollout = RayRollout(ray, self.engines, ahead=bool(cfg.rollout.max_staleness))
        self.loop: RLLoop | None = None
        self.restored_in_flight: dict | None = None  # a resumed run's batches generated ahead

    def __enter__(self) -> "RayPlacement":
        return self

    def __exit__(self, *exc) -> None:
        for actor in [*self.engines, *self.workers]:
            self.ray.kill(actor)
        if self.started_here:
            self.ray.shutdown()

    def describe(self) -> str:
        info = self.ray.get(self.workers[0].info.remote())
        return (f"orchestrator=ray  trainer workers={len(self.workers)}  rollout engines={len(self.engines)}  "
                f"({info['num_params'] / 1e6:.1f}M params)")

    def restore(self, checkpoint: Path) -> dict:
        state = trainer_results(self.ray, [wk.restore.remote(str(checkpoint)) for wk in self.workers],
                                "while loading a checkpoint")[0]
        info = self.ray.get(self.workers[0].info.remote())
        self.trainer.version, self.trainer.skipped_steps = info["version"], info["skipped_steps"]
        self.restored_in_flight = self.ray.get(self.workers[0].restored_in_flight.remote())
        return state

    def warmup_step(self, step: int) -> dict:
        return trainer_results(self.ray, [wk.warmup_step.remote(step) for wk in self.workers],
                               f"during warm-up step {step}")[0]

    def save(self, step: int, sft_done: bool, warmup_step: int | None = None) -> None:
        """Every worker joins (rank 0 writes, with the batches generated ahead for steps >= `step`; then all meet)."""
        ahead = self.loop.ahead if self.loop is not None else None
        in_flight = ahead.in_flight(step) if ahead is not None else None
        trainer_results(self.ray, [wk.save_checkpoint.remote(str(self.run_dir), step, sft_done, warmup_step,
                                                             in_flight if rank == 0 else None)
                                   for rank, wk in enumerate(self.workers)], "while writing a checkpoint")

    def build_loop(self) -> RLLoop:
        cfg, inputs = self.cfg, self.inputs
        kv_quantizer = RemoteKVQuantizer(self.ray, self.workers) if self.derived.precision.kv_cache_fp8 else None
        if cfg.algo.kl_coef or cfg.algo.log_ref_kl:  # every worker keeps its part of the reference policy
            sizes = [wk.keep_reference.remote(str(self.run_dir)) for wk in self.workers]
            self.trainer.reference_size = trainer_results(self.ray, sizes, "while building the reference policy")[0]
        ahead = None
        if cfg.rollout.max_staleness:  # the engine actors generate ahead while the trainer workers train
            ahead = RolloutsAhead(self.rollout, cfg.rollout.max_staleness, cfg.train.steps, self.restored_in_flight)
        self.loop = RLLoop(cfg, self.derived, self.trainer, self.rollout, inputs.task, inputs.encode,
                           inputs.tokenizer.pad_token_id, kv_quantizer, ahead=ahead)
        return self.loop

    def step_metrics(self, metrics: dict) -> dict:
        metrics["rollout/actor_restarts_total"] = float(self.rollout.restarts)
        metrics["rollout/reissued_requests_total"] = float(self.rollout.reissued_requests)
        return metrics

    def skipped_steps(self) -> int:
        return self.trainer.skipped_steps

    def any_rank(self, flag: bool) -> bool:
        return flag  # the driver alone decides
