"""Learning from feedback: losses turn outputs into Feedback, ``await feedback.backward()`` walks the recorded
graph back to the learnable Parameters, and an optimizer's ``step()`` rewrites them with LLMs.

    module.train()
    outputs = await module([x1, x2])               # training-mode outputs carry their forward record
    feedback = await loss(outputs, [t1, t2])
    await feedback.backward()
    await optimizer.step()
    optimizer.zero_feedback()

or all of it: ``history = await train(module, dataset, loss, optimizer, epochs=2, batch_size=4, seed=0)``.
"""

from app.pipeline.backward import BackwardContext, BackwardResult
from app.pipeline.execution.executor import ForwardRecord
from app.pipeline.llm import install_backward
from app.pipeline.optimization.backward import llm_backward
from app.pipeline.optimization.contrast import RubricLevel
from app.pipeline.optimization.demos import (
    DemoCandidate,
    attach_demonstrations,
    candidates_from_examples,
    candidates_from_traces,
)
from app.pipeline.optimization.feedback import Feedback, FeedbackType, combine_feedback, install_propagation
from app.pipeline.optimization.human import (
    CallbackFeedbackSource,
    ConsoleFeedbackSource,
    FeedbackSource,
    HumanAnswer,
    HumanFeedbackLoss,
    HumanFeedbackRequest,
    HumanPreferenceLoss,
    HumanRankingLoss,
    HumanRubricLoss,
    PollingFeedbackSource,
    QueueFeedbackSource,
)
from app.pipeline.optimization.judges import LLMJudge, LLMPreferenceLoss, LLMRankingLoss, LLMRubricLoss
from app.pipeline.optimization.llm import JudgeResponseError
from app.pipeline.optimization.loss import CompositeLoss, Loss, VerifierLoss, field_match
from app.pipeline.optimization.optimizer import Optimizer, ParameterUpdate, SFAOptimizer
from app.pipeline.optimization.pareto import ParetoFront
from app.pipeline.optimization.propagation import BackwardPass, BackwardReport, propagate
from app.pipeline.optimization.selection import (
    Candidate,
    SelectionOptimizer,
    SelectionResult,
    SelectionStep,
    gate,
)
from app.pipeline.optimization.training import (
    EpochSummary,
    EvaluationResult,
    Example,
    TrainingHistory,
    TrainingStep,
    evaluate,
    train,
)
from app.pipeline.record import TracedOutput, split_output, unwrap_output

# The backward pass builds on Feedback and on LLMInference, so they reach it through these hooks.
install_propagation(propagate)
install_backward(llm_backward)

__all__ = [
    "BackwardContext",
    "BackwardPass",
    "BackwardReport",
    "BackwardResult",
    "CallbackFeedbackSource",
    "Candidate",
    "CompositeLoss",
    "ConsoleFeedbackSource",
    "DemoCandidate",
    "EpochSummary",
    "EvaluationResult",
    "Example",
    "Feedback",
    "FeedbackSource",
    "FeedbackType",
    "ForwardRecord",
    "HumanAnswer",
    "HumanFeedbackLoss",
    "HumanFeedbackRequest",
    "HumanPreferenceLoss",
    "HumanRankingLoss",
    "HumanRubricLoss",
    "JudgeResponseError",
    "LLMJudge",
    "LLMPreferenceLoss",
    "LLMRankingLoss",
    "LLMRubricLoss",
    "Loss",
    "Optimizer",
    "ParameterUpdate",
    "ParetoFront",
    "PollingFeedbackSource",
    "QueueFeedbackSource",
    "RubricLevel",
    "SFAOptimizer",
    "SelectionOptimizer",
    "SelectionResult",
    "SelectionStep",
    "TracedOutput",
    "TrainingHistory",
    "TrainingStep",
    "VerifierLoss",
    "attach_demonstrations",
    "candidates_from_examples",
    "candidates_from_traces",
    "combine_feedback",
    "evaluate",
    "field_match",
    "gate",
    "llm_backward",
    "split_output",
    "train",
    "unwrap_output",
]
