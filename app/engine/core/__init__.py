"""The torch-free engine core: requests and sequences, sampling params, stop checks, the paged KV-cache block
manager (with chained block hashes for prefix caching) and the continuous-batching scheduler.

Pure CPU bookkeeping with no model and no tensor: it imports nothing from torch (directly or through another
module), so it is tested by feeding fake sampled tokens, and the rest of the engine builds on it.
"""

from app.engine.core.block_manager import BlockManager, hash_block, num_blocks_for_budget
from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from app.engine.core.scheduler import QueueFullError, Scheduler, SchedulerConfig, SchedulerOutput
from app.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from app.engine.core.stop_checker import StopChecker, partial_stop_length

__all__ = [
    "BlockManager",
    "QueueFullError",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "StopChecker",
    "StructuredOutputsParams",
    "hash_block",
    "num_blocks_for_budget",
    "partial_stop_length",
]
