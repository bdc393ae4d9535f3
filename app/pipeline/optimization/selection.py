"""A selection-gated optimizer (GEPA's loop, with few-shot demonstrations searched beside the instructions).

``SelectionOptimizer(module, loss, budget=..., seed=...).fit(train, validation)`` improves every learnable
parameter of ``module`` (system prompts, and the ``Demonstrations`` it attaches to every LLM call) by measured
selection rather than blind updates. Per step:

1. a parent is drawn from the Pareto front over the validation examples, weighted by how many examples it wins
   (GEPA, arXiv 2507.19457): a candidate that is best on some examples survives even if its mean is not best;
2. the parent runs on a seeded minibatch of training examples (its passing traces join the demonstration pool);
3. ``candidates_per_step`` children are proposed: an instruction rewritten from the minibatch feedback (the SFA
   updater, as ``SFAOptimizer`` does) and demonstration sets drawn from the pool (labelled training examples and
   passing traces, never the validation set), each keeping the rest of the parent;
4. each child is scored on the same minibatch; it passes the gate only when its mean gain over the parent
   exceeds the noise of that gain: ``mean(d) > noise_z * stdev(d) / sqrt(n)`` over the paired per-example
   differences ``d`` (a standard error of a paired mean), and ``mean(d) > 0``;
5. the child that passed with the largest gain is scored on the whole validation set and joins the front; it
   becomes the best (what the module ends with) only if its validation mean beats the best so far.

Every example scored costs one metric call; the loop stops before a call would exceed ``budget``. The best is
never replaced by a candidate with a lower validation score, so the validation score of the active version only
rises. Choices are drawn from ``random.Random(seed)``: with a deterministic LM a run repeats exactly.
"""

from __future__ import annotations

import inspect
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.pipeline.demonstrations import Demonstrations, as_text
from app.pipeline.optimization.demos import (
    DemoCandidate,
    candidates_from_examples,
    candidates_from_traces,
    llm_calls,
)
from app.pipeline.optimization.loss import Loss
from app.pipeline.optimization.optimizer import Optimizer, SFAOptimizer
from app.pipeline.optimization.pareto import ParetoFront
from app.pipeline.optimization.training import (
    Example,
    _per_example,
    _run_examples,
    _scope,
    _score,
    _settings,
    as_example,
    evaluate,
)


@dataclass
class Candidate:
    """One proposed parameter state and what was measured of it. ``scores`` are its minibatch scores beside
    ``parent_scores`` (the parent's on the same examples); ``val_scores`` its validation scores when it was
    validated (the seed, and the child that passed its step's gate with the largest gain)."""

    id: int
    parent: int | None
    step: int
    kind: str  # "seed", "instruction" or "demos"
    state: dict[str, Any]
    changed: list[str] = field(default_factory=list)  # parameters that differ from the parent
    minibatch: list[int] = field(default_factory=list)  # training example indices
    parent_scores: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    gain: float | None = None
    noise: float | None = None
    accepted: bool = False
    val_scores: list[float] | None = None
    best: bool = False  # became the best (active) candidate when validated
    note: str = ""

    @property
    def minibatch_score(self) -> float | None:
        return _mean(self.scores)

    @property
    def parent_minibatch_score(self) -> float | None:
        return _mean(self.parent_scores)

    @property
    def val_score(self) -> float | None:
        return None if self.val_scores is None else _mean(self.val_scores)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "parent": self.parent, "step": self.step, "kind": self.kind,
            "state": dict(self.state), "changed": list(self.changed), "minibatch": list(self.minibatch),
            "parent_minibatch_score": self.parent_minibatch_score, "minibatch_score": self.minibatch_score,
            "parent_scores": list(self.parent_scores), "scores": list(self.scores),
            "gain": self.gain, "noise": self.noise, "accepted": self.accepted,
            "val_score": self.val_score, "val_scores": None if self.val_scores is None else list(self.val_scores),
            "best": self.best, "note": self.note,
        }


@dataclass
class SelectionStep:
    """One step: the parent, its minibatch, the children proposed, and the best after the step."""

    step: int
    parent: int | None
    minibatch: list[int]
    candidates: list[Candidate]
    best: int
    best_val_score: float | None
    metric_calls: int


@dataclass
class SelectionResult:
    candidates: list[Candidate]
    steps: list[SelectionStep]
    best: Candidate
    initial_state: dict[str, Any]
    final_state: dict[str, Any]
    metric_calls: int
    budget: int
    stopped: str  # why the loop ended: "budget", "max_steps" or "perfect" (every validation example passed)

    @property
    def best_val_scores(self) -> list[float | None]:
        """The validation score of the best candidate after the seed and after every step (never falls)."""
        first = self.candidates[0].val_score
        return [first, *(s.best_val_score for s in self.steps)]


class BudgetExhausted(Exception):
    """The next evaluation would spend more metric calls than the budget has left."""


Callback = Callable[[Any], Any]


class SelectionOptimizer:
    """See the module docstring. ``demonstrations=True`` attaches a learnable ``Demonstrations`` to every LLM call
    (unless the pipeline declares one); ``rewrite_instructions`` proposes one rewritten system prompt per step
    when the parent failed some of its minibatch. ``on_step(SelectionStep)`` (sync or async) sees each step,
    the seed's evaluation as step 0, which is what a training job stores."""

    UPDATER_ALIASES = (Optimizer.AGGREGATOR_ALIAS, Optimizer.UPDATER_ALIAS)

    def __init__(
        self,
        module: Any,
        loss: Loss,
        *,
        budget: int = 1000,
        candidates_per_step: int = 4,
        minibatch_size: int = 8,
        max_demos: int = 4,
        noise_z: float = 1.0,
        seed: int = 0,
        demonstrations: bool = True,
        rewrite_instructions: bool = True,
        conservatism: float = 0.5,
        max_tokens: int | None = 256,
        max_steps: int | None = None,
        on_step: Callback | None = None,
    ) -> None:
        _check_positive(budget=budget, candidates_per_step=candidates_per_step, minibatch_size=minibatch_size,
                        max_demos=max_demos)
        if noise_z < 0:
            raise ValueError(f"noise_z must be >= 0, got {noise_z}")
        self.module, self.loss = module, loss
        self.budget, self.k, self.b = budget, candidates_per_step, minibatch_size
        self.max_demos, self.noise_z, self.seed, self.max_steps = max_demos, noise_z, seed, max_steps
        self.on_step = on_step
        if demonstrations:
            for _, call in llm_calls(module):
                call.attach_demos()
        learnable = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.demo_params: dict[str, str] = {}  # call path -> parameter name
        for path, call in llm_calls(module):
            if isinstance(call.demos, Demonstrations) and call.demos.requires_grad:
                self.demo_params[path] = f"{path}.demos" if path else "demos"
        self.names = sorted(learnable)
        prompts = [p for n, p in learnable.items() if isinstance(p.value, str) and not isinstance(p, Demonstrations)]
        self.rewriter: SFAOptimizer | None = None
        if rewrite_instructions and prompts:
            self.rewriter = SFAOptimizer(prompts, conservatism, max_retries=1, max_tokens=max_tokens)
        self.rng = random.Random(seed)
        self.calls = 0
        self.pools: dict[str, list[DemoCandidate]] = {}
        self._pool_keys: set[tuple[str, str]] = set()
        self._next_call = 0

    def required_aliases(self) -> list[str]:
        return list(self.UPDATER_ALIASES) if self.rewriter is not None else []

    # -- the loop ---------------------------------------------------------------------------------------------------
    async def fit(self, trainset: Sequence[Any], valset: Sequence[Any], *, resources: Any = None,
                  max_concurrent: int | None = None) -> SelectionResult:
        train = [as_example(item) for item in trainset]
        val = [as_example(item) for item in valset]
        if not train or not val:
            raise ValueError("SelectionOptimizer.fit() needs a non-empty training set and a non-empty validation set")
        self._resources, self._max_concurrent = resources, max_concurrent
        async with _scope(resources):
            if self.rewriter is not None and resources is not None:
                self.rewriter.bind(resources)
            return await self._fit(train, val)

    async def _fit(self, train: list[Example], val: list[Example]) -> SelectionResult:
        if self.budget < len(val) + 2 * min(self.b, len(train)):
            raise ValueError(f"a budget of {self.budget} metric calls cannot pay for one validation ({len(val)}) "
                             f"and one step (twice the minibatch, {2 * min(self.b, len(train))})")
        initial = self._state()
        self._add_to_pool(candidates_from_examples(self.module, train))  # the training split only
        seed = Candidate(0, None, 0, "seed", initial, note="the starting parameters")
        seed.val_scores = await self._scores(seed.state, val)
        seed.accepted = seed.best = True
        candidates, steps = [seed], []
        front = ParetoFront(len(val))
        front.add(seed.id, seed.val_scores)
        best = seed
        await self._notify(SelectionStep(0, None, [], [seed], best.id, best.val_score, self.calls))
        stopped, number = "budget", 0
        while self.max_steps is None or number < self.max_steps:
            if _perfect(best.val_scores):  # every validation example passes: no candidate can win, stop spending
                stopped = "perfect"
                break
            number += 1
            try:
                step = await self._step(number, train, val, candidates, front, best)
            except BudgetExhausted:
                break
            steps.append(step)
            best = next(c for c in candidates if c.id == step.best)
            await self._notify(step)
        else:
            stopped = "max_steps"
        self._load(best.state)
        return SelectionResult(candidates, steps, best, initial, self._state(), self.calls, self.budget, stopped)

    async def _step(self, number: int, train: list[Example], val: list[Example], candidates: list[Candidate],
                    front: ParetoFront, best: Candidate) -> SelectionStep:
        by_id = {c.id: c for c in candidates}
        parent = by_id[front.choose(self.rng, {c.id: c.val_score or 0.0 for c in candidates})]
        batch = sorted(self.rng.sample(range(len(train)), min(self.b, len(train))))
        examples = [train[i] for i in batch]
        self._reserve(len(batch) * 2)  # the parent and at least one child, or no step at all
        parent_scores, rewrite = await self._run_parent(parent, examples)
        children: list[Candidate] = []
        if min(parent_scores) >= 1.0:  # nothing on this minibatch to beat: spend no calls on children (as GEPA)
            return SelectionStep(number, parent.id, batch, children, best.id, best.val_score, self.calls)
        for kind, state in self._proposals(parent, rewrite, candidates):
            child = Candidate(len(candidates) + len(children), parent.id, number, kind, state,
                              changed=[n for n in self.names if state[n] != parent.state[n]], minibatch=batch,
                              parent_scores=parent_scores)
            if self.calls + len(batch) > self.budget:
                child.note = "not scored: the metric-call budget ran out"
                children.append(child)
                continue
            child.scores = await self._scores(state, examples)
            child.gain, child.noise = gate(child.scores, parent_scores, self.noise_z)
            children.append(child)
        candidates.extend(children)
        best = await self._validate(children, val, front, best)
        return SelectionStep(number, parent.id, batch, children, best.id, best.val_score, self.calls)

    async def _validate(self, children: list[Candidate], val: list[Example], front: ParetoFront,
                        best: Candidate) -> Candidate:
        """Score on validation the child that passed the gate with the largest gain; it joins the front, and
        becomes the best only with a higher validation mean."""
        passed = [c for c in children if c.gain is not None and c.noise is not None and c.gain > max(c.noise, 0.0)]
        for child in children:
            if child.scores and child not in passed:
                child.note = f"rejected: gain {child.gain:+.3f} not above the noise {child.noise:.3f}"
        if not passed:
            return best
        chosen = max(passed, key=lambda c: (c.gain or 0.0, -c.id))
        for child in passed:
            if child is not chosen:
                child.note = "beat its parent, but a sibling gained more (one validation per step)"
        if self.calls + len(val) > self.budget:
            chosen.note = "beat its parent, but the budget cannot pay for its validation"
            raise BudgetExhausted
        chosen.val_scores = await self._scores(chosen.state, val)
        chosen.accepted = True
        front.add(chosen.id, chosen.val_scores)
        if (chosen.val_score or 0.0) > (best.val_score or 0.0):
            chosen.best, chosen.note = True, "accepted; the best validation score so far"
            return chosen
        chosen.note = "accepted into the front; the best validation score stays with another candidate"
        return best

    # -- the parent's minibatch: scores, traces for demonstrations, and a rewritten instruction -----------------------
    async def _run_parent(self, parent: Candidate, examples: list[Example]) -> tuple[list[float], dict[str, Any]]:
        self._load(parent.state)
        self.calls += len(examples)
        was_training = bool(getattr(self.module, "training", False))
        self.module.train()
        try:
            outputs = await _run_examples(self.module, examples, _settings(self._resources, self._max_concurrent))
        finally:
            self.module.train(was_training)
        feedback, ok = await _score(self.loss, outputs, examples)
        per = _per_example(len(examples), feedback, ok)
        scores = [f.score if f is not None and f.score is not None else 0.0 for f in per]
        traced = [None if isinstance(o, BaseException) else o for o in outputs]
        self._add_to_pool(candidates_from_traces(traced, scores))
        rewrite: dict[str, Any] = {}
        if self.rewriter is not None and feedback is not None and min(scores) < 1.0:
            self.rewriter.zero_feedback()
            await feedback.backward(optimizer=self.rewriter)
            await self.rewriter.step()
            rewrite = {u.name: u.new_value for u in self.rewriter.last_updates if u.changed}
            self.rewriter.zero_feedback()
            self._load(parent.state)  # the rewrite is a proposal, not an update
        return scores, rewrite

    def _proposals(self, parent: Candidate, rewrite: dict[str, Any],
                   candidates: list[Candidate]) -> list[tuple[str, dict[str, Any]]]:
        seen = [c.state for c in candidates]
        out: list[tuple[str, dict[str, Any]]] = []
        if rewrite:
            out.append(("instruction", {**parent.state, **rewrite}))
        attempts = 0
        while len(out) < self.k and attempts < self.k * 5 and self.demo_params:
            attempts += 1
            state = self._demo_proposal(parent.state)
            if state is not None and state not in seen and all(state != s for _, s in out):
                out.append(("demos", state))
        return out[: self.k]

    # -- demonstrations ----------------------------------------------------------------------------------------------
    def _add_to_pool(self, found: dict[str, list[DemoCandidate]]) -> None:
        for path, items in sorted(found.items()):
            for item in items:
                key = (path, as_text(item.input))
                if path in self.demo_params and key not in self._pool_keys:
                    self._pool_keys.add(key)
                    self.pools.setdefault(path, []).append(item)

    def _demo_proposal(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The parent's state with one call's demonstrations changed: one demonstration swapped for another from
        the pool (half the time, when it has some), or a fresh draw of 1..max_demos."""
        paths = sorted(self.demo_params)
        path = paths[self._next_call % len(paths)]  # round robin over the calls, as GEPA over modules
        self._next_call += 1
        pool = self.pools.get(path, [])
        if not pool:
            return None
        name = self.demo_params[path]
        current = list(state[name])
        if current and self.rng.random() < 0.5:
            shown = {as_text(d["input"]) for d in current}
            spare = [c for c in pool if as_text(c.input) not in shown]
            if not spare:
                return None
            current[self.rng.randrange(len(current))] = self.rng.choice(spare).demo()
            return {**state, name: current}
        return {**state, name: draw_demos(pool, self.rng.randint(1, self.max_demos), self.rng)}

    # -- evaluation and state -------------------------------------------------------------------------------------
    async def _scores(self, state: dict[str, Any], examples: list[Example]) -> list[float]:
        self._reserve(len(examples))
        self._load(state)
        self.calls += len(examples)
        result = await evaluate(self.module, examples, self.loss, resources=self._resources,
                                max_concurrent=self._max_concurrent)
        return [0.0 if i in result.errors or s is None else float(s) for i, s in enumerate(result.scores)]

    def _reserve(self, calls: int) -> None:
        if self.calls + calls > self.budget:
            raise BudgetExhausted

    def _state(self) -> dict[str, Any]:
        state = self.module.state_dict()
        return {name: _copy(state[name]) for name in self.names}

    def _load(self, state: dict[str, Any]) -> None:
        params = dict(self.module.named_parameters())
        for name, value in state.items():
            if params[name].value != value:
                params[name].apply_update(_copy(value))  # bumps the owner's state version, as any update does

    async def _notify(self, step: SelectionStep) -> None:
        if self.on_step is not None:
            result = self.on_step(step)
            if inspect.isawaitable(result):
                await result


def gate(scores: Sequence[float], parent_scores: Sequence[float], z: float) -> tuple[float, float]:
    """``(mean gain, noise)`` of a child over its parent on the same examples: the noise is ``z`` standard errors
    of the paired differences (0 when all differences are equal; then any positive gain passes)."""
    diffs = [a - b for a, b in zip(scores, parent_scores, strict=True)]
    gain = sum(diffs) / len(diffs)
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    return gain, z * spread / math.sqrt(len(diffs))


def draw_demos(pool: Sequence[DemoCandidate], count: int, rng: random.Random) -> list[dict[str, Any]]:
    """``count`` demonstrations from ``pool``, taking outputs in turn (for a classifier, labels in turn) so one
    answer does not fill the prompt by chance; outputs that are all different make this a plain random sample."""
    groups: dict[str, list[DemoCandidate]] = {}
    for item in pool:
        groups.setdefault(as_text(item.output), []).append(item)
    lists = [rng.sample(items, len(items)) for _, items in sorted(groups.items())]
    rng.shuffle(lists)
    picked: list[DemoCandidate] = []
    depth = 0
    while len(picked) < min(count, len(pool)):
        for items in lists:
            if depth < len(items) and len(picked) < count:
                picked.append(items[depth])
        depth += 1
    rng.shuffle(picked)  # the last demonstration (nearest the input) should not always be one label
    return [item.demo() for item in picked]


def _perfect(scores: Sequence[float | None] | None) -> bool:
    return bool(scores) and all(s is not None and s >= 1.0 for s in scores or ())


def _mean(scores: Sequence[float] | None) -> float | None:
    return sum(scores) / len(scores) if scores else None


def _copy(value: Any) -> Any:
    return [dict(d) for d in value] if isinstance(value, list) else value


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
