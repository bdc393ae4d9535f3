"""Human feedback through a queue (what a REST API answers), a callback, or the console."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.pipeline.optimization import (
    CallbackFeedbackSource,
    ConsoleFeedbackSource,
    FeedbackType,
    HumanAnswer,
    HumanFeedbackLoss,
    HumanFeedbackRequest,
    HumanPreferenceLoss,
    HumanRankingLoss,
    HumanRubricLoss,
    PollingFeedbackSource,
    QueueFeedbackSource,
)


class TestQueueSource:
    async def test_requests_wait_until_submitted(self) -> None:
        source = QueueFeedbackSource()
        loss = HumanFeedbackLoss(source, criteria="tone")
        task = asyncio.create_task(loss("Dear sir", target="friendly"))
        request = await source.next_request(timeout=1)
        assert [r.id for r in source.pending()] == [request.id]
        shown = request.to_dict()
        assert shown["kind"] == "freeform" and shown["outputs"] == ["Dear sir"] and shown["target"] == "friendly"
        assert shown["criteria"] == "tone"
        assert not task.done()
        source.submit(request.id, content="Too formal.", score=0.3)
        feedback = await asyncio.wait_for(task, 1)
        assert (feedback.content, feedback.score, feedback.feedback_type) == ("Too formal.", 0.3, FeedbackType.HUMAN)
        assert source.pending() == []

    async def test_a_bad_answer_is_refused_and_the_request_stays_open(self) -> None:
        source = QueueFeedbackSource()
        task = asyncio.create_task(HumanRubricLoss("clarity", {1: "unclear", 5: "clear"}, source)("text"))
        request = await source.next_request(timeout=1)
        with pytest.raises(ValueError, match=r"one of the rubric's levels \[1, 5\]"):
            source.submit(request.id, score=3, content="meh")
        with pytest.raises(ValueError, match="written feedback is required"):
            source.submit(request.id, score=5)
        with pytest.raises(KeyError):
            source.submit("no-such-id", score=5)
        assert source.get(request.id) is request
        answer = source.submit(request.id, {"score": 5, "content": "crisp"})
        assert answer == HumanAnswer(content="crisp", score=5.0)
        feedback = await asyncio.wait_for(task, 1)
        assert feedback.score == 1.0 and feedback.metadata["raw_score"] == 5

    async def test_submit_from_another_thread(self) -> None:
        source = QueueFeedbackSource()
        task = asyncio.create_task(HumanFeedbackLoss(source)("out"))
        request = await source.next_request(timeout=1)
        worker = threading.Thread(target=lambda: source.submit(request.id, "fine from a web handler"))
        worker.start()
        feedback = await asyncio.wait_for(task, 1)
        worker.join()
        assert feedback.content == "fine from a web handler"

    async def test_batch_requests_are_open_together(self) -> None:
        source = QueueFeedbackSource()
        task = asyncio.create_task(HumanFeedbackLoss(source)(["a", "b", "c"]))
        for _ in range(3):
            await source.next_request(timeout=1)
        pending = source.pending()
        assert sorted(r.outputs[0] for r in pending) == ["a", "b", "c"]
        for request in pending:
            source.submit(request.id, content=f"about {request.outputs[0]}", score=0.5)
        feedback = await asyncio.wait_for(task, 1)
        assert [f.content for f in feedback.items] == ["about a", "about b", "about c"]

    async def test_timeout_and_cancel(self) -> None:
        with pytest.raises(TimeoutError):
            await HumanFeedbackLoss(QueueFeedbackSource(timeout=0.05))("x")
        source = QueueFeedbackSource()
        task = asyncio.create_task(HumanFeedbackLoss(source)("x"))
        request = await source.next_request(timeout=1)
        source.cancel(request.id)
        with pytest.raises(RuntimeError, match="cancelled"):
            await asyncio.wait_for(task, 1)

    async def test_on_request_hook_sees_each_request(self) -> None:
        seen: list[HumanFeedbackRequest] = []
        source = QueueFeedbackSource(on_request=seen.append)
        task = asyncio.create_task(HumanFeedbackLoss(source)("x"))
        request = await source.next_request(timeout=1)
        assert seen == [request]
        source.submit(request.id, "ok")
        await task


class TestCallbackSource:
    async def test_preference_from_a_function(self) -> None:
        loss = HumanPreferenceLoss("helpfulness", lambda req: {"choice": "b", "content": "B answers the question"})
        fb_a, fb_b = await loss.compare("hello", "the answer is 4")
        assert (fb_a.score, fb_b.score) == (0.0, 1.0)
        assert "B answers the question" in fb_a.content and "the answer is 4" in fb_a.content

    async def test_async_callback_ranking(self) -> None:
        async def rank(request: HumanFeedbackRequest) -> HumanAnswer:
            assert request.kind == "ranking" and request.outputs == ["x", "yy", "zzz"]
            return HumanAnswer(ranking=[3, 2, 1], content="longer is better here")

        feedbacks = await HumanRankingLoss("detail", n=3, source=CallbackFeedbackSource(rank)).rank(["x", "yy", "zzz"])
        assert [f.score for f in feedbacks] == [0.0, 0.5, 1.0]

    async def test_invalid_callback_answers_raise(self) -> None:
        with pytest.raises(ValueError, match='"A" or "B"'):
            await HumanPreferenceLoss("c", lambda req: {"choice": "maybe", "content": "?"}).compare("a", "b")
        with pytest.raises(ValueError, match="exactly once"):
            await HumanRankingLoss("c", source=lambda req: {"ranking": [1, 1], "content": "?"}).rank(["a", "b"])
        with pytest.raises(ValueError, match="unknown answer field"):
            await HumanFeedbackLoss(lambda req: {"text": "hi"})("a")


class TestConsoleSource:
    async def test_reads_answers_and_asks_again_on_invalid_input(self) -> None:
        typed = iter(["7", "4", "Good but long.", ""])
        shown: list[str] = []
        source = ConsoleFeedbackSource(input_fn=lambda prompt: next(typed), output_fn=shown.append)
        feedback = await HumanRubricLoss("quality", {1: "bad", 4: "good"}, source)("the output")
        assert feedback.score == 1.0 and feedback.content == "Good but long."
        assert any("the output" in line for line in shown)
        assert any("Invalid answer" in line for line in shown)


class TestPollingSource:
    async def test_answers_stored_elsewhere_are_polled_for(self) -> None:
        store: dict[str, dict] = {}
        answers: dict[str, dict] = {}

        async def publish(request: HumanFeedbackRequest) -> None:
            store[request.id] = request.to_dict()

        source = PollingFeedbackSource(publish, answers.get, interval=0.01)
        task = asyncio.create_task(HumanRubricLoss("c", {1: "bad", 2: "good"}, source)("out"))
        while not store:
            await asyncio.sleep(0.005)
        (request_id, stored), = store.items()
        # the process that receives the answer rebuilds the request to validate it
        rebuilt = HumanFeedbackRequest.from_dict(stored)
        with pytest.raises(ValueError, match="levels"):
            rebuilt.validate({"score": 7, "content": "x"})
        answers[request_id] = {"score": 2, "content": "good"}
        feedback = await asyncio.wait_for(task, 1)
        assert feedback.score == 1.0 and feedback.content == "good"

    async def test_timeout(self) -> None:
        source = PollingFeedbackSource(lambda req: None, lambda rid: None, interval=0.01, timeout=0.03)
        with pytest.raises(TimeoutError, match="no answer"):
            await HumanFeedbackLoss(source)("x")
