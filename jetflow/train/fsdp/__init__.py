"""FSDP2 training backend (`train.backend=fsdp`): the native Decoder sharded with torch's `fully_shard`
(jetflow.train.fsdp.policy) and its optimizer state checkpointed with torch.distributed.checkpoint
(jetflow.train.fsdp.state)."""

from jetflow.train.fsdp.policy import FSDPPolicy

__all__ = ["FSDPPolicy"]
