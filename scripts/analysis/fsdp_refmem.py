"""Per-rank bytes of the FSDP policy's shards vs its frozen reference (jetflow.train.reference.reference_nbytes)."""
import sys
import tempfile
import time
import torch.distributed as dist
from jetflow.config import load_config
from jetflow.run.build import load_inputs
from jetflow.run.sides import TrainerSide
from jetflow.run.validate import check_config
from jetflow.train.reference import reference_nbytes

config, mode = sys.argv[1], sys.argv[2]
out = tempfile.mkdtemp()
cfg = load_config(config, [f"run.out_dir={out}", f"precision.mode={mode}", "train.backend=fsdp", "algo.kl_coef=0.05",
                           "run.num_threads=1", "eval.num_prompts=0", *sys.argv[3:]])
side = TrainerSide(cfg, check_config(cfg), load_inputs(cfg))
policy_fp32 = sum(p._local_tensor.numel() * 4 for p in side.model.parameters())
t0 = time.perf_counter()
side.keep_reference(None)
t = time.perf_counter() - t0
assert side.trainer.reference is not None
print(f"rank {dist.get_rank()}/{dist.get_world_size()} {config} {mode}: policy fp32 shards {policy_fp32} B, "
      f"reference {reference_nbytes(side.trainer.reference)} B ({reference_nbytes(side.trainer.reference) / policy_fp32:.3f}x), "
      f"built in {t:.2f} s", flush=True)
