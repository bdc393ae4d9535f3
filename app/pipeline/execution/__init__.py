from app.pipeline.execution.checkpoint import Checkpoint, CheckpointManager
from app.pipeline.execution.executor import BatchResult, ExecutionError, ForwardRecord, call_module, run
from app.pipeline.execution.scheduler import Scheduler
from app.pipeline.execution.state import ExecutionState, Task, TaskResult, TaskStatus
from app.pipeline.module import install_runner
from app.pipeline.run_settings import ExecutionSettings, get_execution_settings

# modules sit below the runtime: `await module(x)` with resources reaches call_module through this hook
install_runner(call_module)

__all__ = [
    "BatchResult",
    "Checkpoint",
    "CheckpointManager",
    "ExecutionError",
    "ExecutionSettings",
    "ExecutionState",
    "ForwardRecord",
    "Scheduler",
    "Task",
    "TaskResult",
    "TaskStatus",
    "get_execution_settings",
    "run",
]
