"""Human feedback: losses whose answers come from people, through a pluggable source.

A loss sends a ``HumanFeedbackRequest`` to its ``FeedbackSource`` and awaits a ``HumanAnswer``:

* ``QueueFeedbackSource``: requests wait in memory until something (the REST API, a UI, a test) lists them with
  ``pending()`` and answers with ``submit(request_id, ...)``; a bad answer is refused with a ValueError and the
  request stays open;
* ``PollingFeedbackSource(publish, fetch)``: for answers that arrive in another process (a REST API writing
  them to a database): the request is published, then its answer polled for;
* ``CallbackFeedbackSource(fn)``: ``fn(request)`` (sync or async) answers;
* ``ConsoleFeedbackSource``: asks on the terminal (the default, for scripts).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Self, runtime_checkable

from app.pipeline.optimization.contrast import (
    RubricLevel,
    check_ranking,
    normalise_rubric,
    preference_feedback,
    ranking_feedback,
    rubric_score,
    rubric_text,
)
from app.pipeline.optimization.feedback import Feedback, FeedbackType
from app.pipeline.optimization.loss import Loss
from app.pipeline.record import split_output


@dataclass
class HumanAnswer:
    """What a person answered: free text, and per kind a rubric score, a choice ("A"/"B") or a ranking."""

    content: str = ""
    score: float | None = None
    choice: str | None = None
    ranking: list[int] | None = None


def coerce_answer(answer: Any) -> HumanAnswer:
    if isinstance(answer, HumanAnswer):
        return answer
    if isinstance(answer, str):
        return HumanAnswer(content=answer)
    if isinstance(answer, Mapping):
        known = {"content", "score", "choice", "ranking"}
        unknown = sorted(set(answer) - known)
        if unknown:
            raise ValueError(f"unknown answer field(s) {unknown}; an answer has {sorted(known)}")
        return HumanAnswer(**dict(answer))
    raise TypeError(f"a human answer must be a HumanAnswer, a dict or a string, got {type(answer).__name__}")


@dataclass
class HumanFeedbackRequest:
    """One question to a person. ``kind`` is freeform, rubric, preference or ranking; ``outputs`` holds the
    output(s) to judge (two for a preference, several for a ranking)."""

    kind: str
    outputs: list[Any]
    criteria: str | None = None
    target: Any = None
    context: Any = None
    rubric: list[RubricLevel] = field(default_factory=list)
    require_feedback: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def validate(self, answer: Any) -> HumanAnswer:
        """The answer, normalised, or a ValueError that says what a valid one looks like."""
        answer = coerce_answer(answer)
        answer.content = (answer.content or "").strip()
        if self.kind == "freeform":
            if answer.score is not None and not 0.0 <= float(answer.score) <= 1.0:
                raise ValueError(f"an optional score must be within [0, 1], got {answer.score}")
            if not answer.content:
                raise ValueError("the feedback text is empty: say what is good or bad about the output")
        elif self.kind == "rubric":
            allowed = [level.score for level in self.rubric]
            if answer.score is None or float(answer.score) not in allowed:
                raise ValueError(f"the score must be one of the rubric's levels {allowed}, got {answer.score}")
            answer.score = float(answer.score)
        elif self.kind == "preference":
            choice = str(answer.choice or "").strip().upper()
            if choice not in ("A", "B"):
                raise ValueError(f'the choice must be "A" or "B", got {answer.choice!r}')
            answer.choice = choice
        elif self.kind == "ranking":
            answer.ranking = check_ranking(answer.ranking or [], len(self.outputs))
        else:
            raise ValueError(f"unknown request kind {self.kind!r}")
        if self.require_feedback and not answer.content:
            raise ValueError("written feedback is required for this request: explain the answer in `content`")
        return answer

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what a REST API shows to the person answering)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "outputs": [_plain(o) for o in self.outputs],
            "criteria": self.criteria,
            "target": _plain(self.target),
            "context": _plain(self.context),
            "rubric": [asdict(level) for level in self.rubric],
            "require_feedback": self.require_feedback,
        }


    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HumanFeedbackRequest:
        """Rebuild a stored request (e.g. in the process that receives the answer, to validate it there)."""
        return cls(
            kind=data["kind"],
            outputs=list(data.get("outputs") or []),
            criteria=data.get("criteria"),
            target=data.get("target"),
            context=data.get("context"),
            rubric=[RubricLevel(**level) for level in data.get("rubric") or []],
            require_feedback=bool(data.get("require_feedback", False)),
            id=data["id"],
        )


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    return str(value)


@runtime_checkable
class FeedbackSource(Protocol):
    async def request(self, request: HumanFeedbackRequest) -> Any:
        """Return the person's answer (HumanAnswer, dict or string) to ``request``."""
        ...


class CallbackFeedbackSource:
    """Answers come from ``fn(request)``, sync or async."""

    def __init__(self, fn: Callable[[HumanFeedbackRequest], Any | Awaitable[Any]]) -> None:
        self.fn = fn

    async def request(self, request: HumanFeedbackRequest) -> Any:
        answer = self.fn(request)
        if inspect.isawaitable(answer):
            answer = await answer
        return answer


class QueueFeedbackSource:
    """Open requests wait until ``submit()`` answers them (from any thread: a web handler, a UI).

    ``on_request`` (optional) is called with each new request, e.g. to store or announce it; ``timeout`` bounds
    how long a loss waits (TimeoutError after it)."""

    def __init__(self, *, on_request: Callable[[HumanFeedbackRequest], Any] | None = None,
                 timeout: float | None = None) -> None:
        self.on_request = on_request
        self.timeout = timeout
        self._open: dict[str, tuple[HumanFeedbackRequest, asyncio.Future[HumanAnswer], asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._arrivals: asyncio.Queue[HumanFeedbackRequest] | None = None

    async def request(self, request: HumanFeedbackRequest) -> HumanAnswer:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[HumanAnswer] = loop.create_future()
        with self._lock:
            self._open[request.id] = (request, future, loop)
        try:
            if self._arrivals is not None:
                self._arrivals.put_nowait(request)
            if self.on_request is not None:
                result = self.on_request(request)
                if inspect.isawaitable(result):
                    await result
            return await asyncio.wait_for(future, self.timeout)
        finally:
            with self._lock:
                self._open.pop(request.id, None)

    def pending(self) -> list[HumanFeedbackRequest]:
        """The requests waiting for an answer, oldest first."""
        with self._lock:
            return [entry[0] for entry in self._open.values()]

    def get(self, request_id: str) -> HumanFeedbackRequest:
        with self._lock:
            entry = self._open.get(request_id)
        if entry is None:
            raise KeyError(f"no open feedback request {request_id!r} (answered, cancelled, or never asked)")
        return entry[0]

    def submit(self, request_id: str, answer: Any = None, **fields: Any) -> HumanAnswer:
        """Answer an open request (``answer`` or the answer's fields as keywords). A ValueError (the answer is
        invalid; the request stays open) or KeyError (no such open request) tells the caller what went wrong."""
        with self._lock:
            entry = self._open.get(request_id)
        if entry is None:
            raise KeyError(f"no open feedback request {request_id!r} (answered, cancelled, or never asked)")
        request, future, loop = entry
        valid = request.validate(answer if answer is not None else fields)
        with self._lock:
            if self._open.pop(request_id, None) is None:
                raise KeyError(f"feedback request {request_id!r} was answered meanwhile")
        loop.call_soon_threadsafe(_resolve, future, valid)
        return valid

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        with self._lock:
            entry = self._open.pop(request_id, None)
        if entry is None:
            raise KeyError(f"no open feedback request {request_id!r}")
        _, future, loop = entry
        loop.call_soon_threadsafe(_fail, future, RuntimeError(f"feedback request {request_id} {reason}"))

    async def next_request(self, timeout: float | None = None) -> HumanFeedbackRequest:
        """Wait for the next request to arrive (or return the oldest one already open)."""
        if self._arrivals is None:
            self._arrivals = asyncio.Queue()
            for request in self.pending():
                self._arrivals.put_nowait(request)
        while True:
            request = await asyncio.wait_for(self._arrivals.get(), timeout)
            with self._lock:
                if request.id in self._open:
                    return request


def _resolve(future: asyncio.Future[HumanAnswer], answer: HumanAnswer) -> None:
    if not future.done():
        future.set_result(answer)


def _fail(future: asyncio.Future[HumanAnswer], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class PollingFeedbackSource:
    """For answers that arrive in another process, e.g. a REST API that stores them in a database:
    ``publish(request)`` stores the open request (``request.to_dict()``), ``fetch(request_id)`` returns its answer
    once there is one (None before) and is polled every ``interval`` seconds, up to ``timeout``. Both may be
    sync or async."""

    def __init__(
        self,
        publish: Callable[[HumanFeedbackRequest], Any],
        fetch: Callable[[str], Any],
        *,
        interval: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.publish = publish
        self.fetch = fetch
        self.interval = interval
        self.timeout = timeout

    async def request(self, request: HumanFeedbackRequest) -> HumanAnswer:
        await _maybe_await(self.publish(request))
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        while True:
            answer = await _maybe_await(self.fetch(request.id))
            if answer is not None:
                return request.validate(answer)
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"no answer to feedback request {request.id} within {self.timeout} s")
            await asyncio.sleep(self.interval)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class ConsoleFeedbackSource:
    """Asks on the terminal (stdin/stdout) one request at a time; invalid answers are asked again."""

    def __init__(self, input_fn: Callable[[str], str] = input, output_fn: Callable[[str], None] = print) -> None:
        self.input_fn = input_fn
        self.output_fn = output_fn
        self._lock = asyncio.Lock()

    async def request(self, request: HumanFeedbackRequest) -> HumanAnswer:
        async with self._lock:  # concurrent batch items must not interleave on one terminal
            return await asyncio.to_thread(self._ask, request)

    def _ask(self, request: HumanFeedbackRequest) -> HumanAnswer:
        out = self.output_fn
        out("=" * 60)
        if request.criteria:
            out(f"Criteria: {request.criteria}")
        for i, output in enumerate(request.outputs):
            label = chr(ord("A") + i) if request.kind == "preference" else str(i + 1)
            out(f"--- Output {label if len(request.outputs) > 1 else ''}".rstrip() + " ---")
            out(str(output))
        if request.target is not None:
            out(f"Expected: {request.target}")
        if request.context:
            out(f"Context: {request.context}")
        if request.rubric:
            out("Rating scale:\n" + rubric_text(request.rubric))
        answer = HumanAnswer()
        if request.kind != "freeform":
            answer = self._until_valid(lambda: self._read_choice(request, answer))
        while True:
            if request.kind == "freeform" or request.require_feedback:
                answer.content = self._lines("Feedback (empty line to finish):")
            try:
                return request.validate(answer)
            except ValueError as exc:
                out(f"Invalid answer: {exc}")

    def _read_choice(self, request: HumanFeedbackRequest, answer: HumanAnswer) -> HumanAnswer:
        """The kind-specific part of the answer (score, choice or ranking), checked before any text is asked."""
        if request.kind == "rubric":
            answer.score = float(self.input_fn("Your score: ").strip())
            allowed = [level.score for level in request.rubric]
            if answer.score not in allowed:
                raise ValueError(f"the score must be one of {allowed}")
        elif request.kind == "preference":
            answer.choice = self.input_fn("Which is better (A/B)? ").strip().upper()
            if answer.choice not in ("A", "B"):
                raise ValueError('answer "A" or "B"')
        elif request.kind == "ranking":
            text = self.input_fn("Ranking, best first (e.g. 3,1,2): ")
            answer.ranking = check_ranking([int(x) for x in text.replace(" ", "").split(",") if x],
                                           len(request.outputs))
        return answer

    def _until_valid(self, read: Callable[[], HumanAnswer]) -> HumanAnswer:
        while True:
            try:
                return read()
            except ValueError as exc:
                self.output_fn(f"Invalid answer: {exc}")

    def _lines(self, prompt: str) -> str:
        self.output_fn(prompt)
        lines: list[str] = []
        while line := self.input_fn("> "):
            lines.append(line)
        return "\n".join(lines)


# -- losses -----------------------------------------------------------------------------------------------------
class _HumanLoss(Loss):
    feedback_type = FeedbackType.HUMAN

    def __init__(self, source: FeedbackSource | Callable[..., Any] | None) -> None:
        if source is None:
            source = ConsoleFeedbackSource()
        elif not isinstance(source, FeedbackSource):
            if not callable(source):
                raise TypeError("source must be a FeedbackSource (request(...)) or a function(request) -> answer")
            source = CallbackFeedbackSource(source)
        self.source: FeedbackSource = source

    async def _ask(self, request: HumanFeedbackRequest) -> HumanAnswer:
        return request.validate(await self.source.request(request))

    def bind(self, resources: Any) -> Self:
        return self


class HumanFeedbackLoss(_HumanLoss):
    """Freeform human critique (and an optional score in [0, 1])."""

    def __init__(self, source: FeedbackSource | Callable[..., Any] | None = None, *,
                 criteria: str | None = None) -> None:
        super().__init__(source)
        self.criteria = criteria

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        answer = await self._ask(HumanFeedbackRequest("freeform", [output], self.criteria, target, context))
        return Feedback(answer.content, answer.score, FeedbackType.HUMAN)


class HumanRubricLoss(_HumanLoss):
    """A person scores the output on a rubric (mapped onto [0, 1]), with written feedback if required."""

    def __init__(self, criteria: str, rubric: Any, source: FeedbackSource | Callable[..., Any] | None = None, *,
                 require_feedback: bool = True) -> None:
        super().__init__(source)
        self.criteria = criteria
        self.rubric = normalise_rubric(rubric)
        self.require_feedback = require_feedback

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        request = HumanFeedbackRequest("rubric", [output], self.criteria, target, context, self.rubric,
                                       self.require_feedback)
        answer = await self._ask(request)
        assert answer.score is not None  # validate() guarantees it
        raw = int(answer.score)
        top = self.rubric[-1].score
        return Feedback(answer.content or f"Scored {raw} of {top} on {self.criteria}.",
                        rubric_score(self.rubric, raw), FeedbackType.HUMAN, {"raw_score": raw})


class HumanPreferenceLoss(_HumanLoss):
    """A person picks the better of two outputs (``compare``), or of the output and a baseline target."""

    def __init__(self, criteria: str, source: FeedbackSource | Callable[..., Any] | None = None, *,
                 require_reason: bool = True) -> None:
        super().__init__(source)
        self.criteria = criteria
        self.require_reason = require_reason

    async def compare(self, output_a: Any, output_b: Any, *, record_a: Any = None, record_b: Any = None,
                      context: Any = None) -> tuple[Feedback, Feedback]:
        value_a, record_a = split_output(output_a, record_a)
        value_b, record_b = split_output(output_b, record_b)
        request = HumanFeedbackRequest("preference", [value_a, value_b], self.criteria, None, context,
                                       require_feedback=self.require_reason)
        answer = await self._ask(request)
        fb_a, fb_b = preference_feedback(answer.choice or "A", value_a, value_b, reason=answer.content,
                                         kind=FeedbackType.HUMAN)
        return fb_a.attach_record(record_a), fb_b.attach_record(record_b)

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        if target is None:
            raise ValueError("HumanPreferenceLoss compares the output with a baseline: pass it as target")
        return (await self.compare(output, target, context=context))[0]


class HumanRankingLoss(_HumanLoss):
    """A person ranks several outputs best to worst; scores by rank (best 1.0, worst 0.0)."""

    def __init__(self, criteria: str, n: int = 4, source: FeedbackSource | Callable[..., Any] | None = None, *,
                 require_feedback: bool = True) -> None:
        super().__init__(source)
        self.criteria = criteria
        self.n = n
        self.require_feedback = require_feedback

    async def rank(self, outputs: list[Any], *, records: list[Any] | None = None,
                   context: Any = None) -> list[Feedback]:
        if len(outputs) < 2:
            raise ValueError(f"HumanRankingLoss needs at least 2 outputs to rank, got {len(outputs)}")
        split = [split_output(out, (records or [None] * len(outputs))[i]) for i, out in enumerate(outputs)]
        values = [value for value, _ in split]
        request = HumanFeedbackRequest("ranking", values, self.criteria, None, context,
                                       require_feedback=self.require_feedback)
        answer = await self._ask(request)
        assert answer.ranking is not None
        feedbacks = ranking_feedback(values, answer.ranking, kind=FeedbackType.HUMAN, comparison=answer.content,
                                     worst=answer.content, best=answer.content)
        return [fb.attach_record(rec) for fb, (_, rec) in zip(feedbacks, split, strict=True)]

    async def evaluate(self, output: Any, target: Any = None, *, context: Any = None) -> Feedback:
        if target is None:
            raise ValueError("HumanRankingLoss ranks the output among others: pass them as target=[...]")
        others = target if isinstance(target, list | tuple) else [target]
        return (await self.rank([output, *others], context=context))[0]
