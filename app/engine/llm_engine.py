"""``LLMEngine``: the synchronous engine loop (schedule → run → sample → update → detokenize → outputs).

One :meth:`LLMEngine.step` advances every scheduled sequence by one model pass. The scheduler decides what
runs (continuous batching, chunked prefill, preemption), the model runner computes the logits, the sampler
picks tokens, the scheduler applies them (length, eos and stop-token stops), and this module turns token
ids into text, applies stop strings and builds :class:`RequestOutput` objects.

Not thread-safe: one thread drives an engine (``AsyncEngine`` serialises access for servers).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from app.engine.block_manager import BlockManager, num_blocks_for_budget
from app.engine.config import ModelConfig
from app.engine.metrics import EngineStats, RequestMetrics, StatsCollector
from app.engine.model_runner import ModelRunner
from app.engine.models.base import PagedCausalLM
from app.engine.outputs import CompletionOutput, RequestOutput
from app.engine.sampler import LogprobsMode, Sampler, SampleResult, SamplingRow, check_params_for_vocab
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig
from app.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from app.engine.spec_decode import DraftModelProposer, SpeculativeConfig, SpeculativeDecoder
from app.engine.stop_checker import StopChecker, partial_stop_length
from app.engine.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["EngineConfig", "EngineQueueFullError", "LLMEngine", "PromptInput"]

log = logging.getLogger(__name__)

GiB = 1 << 30
_MAX_EMPTY_STEPS = 100
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptInput = str | list[int] | Mapping[str, Any]


class EngineQueueFullError(QueueFullError):
    """The bounded waiting queue (``max_waiting``) is full: shed load (HTTP 429/503) and retry later."""


@dataclass
class EngineConfig:
    """Everything that shapes an engine; ``LLMEngine(**kwargs)`` takes the same names."""

    model: str | Path | None = None  # None: the default SmolLM2-135M-Instruct
    dtype: str | torch.dtype = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str | torch.device = "auto"  # "auto": CUDA when available
    block_size: int = 16
    # KV-cache budget in bytes; None: 1 GiB on CPU, 50% of the free memory after loading on CUDA.
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    # Token budget of one step; None: 2048, or max_model_len if larger and prefill cannot be chunked.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's context length (capped by the KV cache)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_waiting: int | None = None  # bounded waiting queue (EngineQueueFullError beyond it); None: unbounded
    num_threads: int | None = None  # torch.set_num_threads when given
    seed: int | None = None  # seeds the sampler for requests without their own seed
    logprobs_mode: LogprobsMode = "raw"
    model_cache_dir: str | Path | None = None  # the converted-GGUF cache; None: the settings' data dir
    served_model_name: str | None = None
    warmup: bool = True
    # Speculative decoding (vLLM's keys): {"method": "ngram", "num_speculative_tokens": 4, ...} or
    # {"method": "draft_model", "model": PATH_OR_LOADED_MODEL, ...}; a dict, a JSON string or a
    # SpeculativeConfig. None: off.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        for name in ("block_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "kv_cache_memory_bytes",
            "max_num_batched_tokens",
            "max_model_len",
            "max_waiting",
            "num_threads",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    def resolve_device(self) -> torch.device:
        if isinstance(self.device, torch.device):
            return self.device
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


# ---- per-request state ---------------------------------------------------------------------------------


class _SeqState:
    """Detokenisation, stop-string and logprob state of one sequence."""

    __slots__ = ("cumulative_logprob", "detok", "logprobs", "num_detok", "seq", "text", "visible")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, want_logprobs: bool) -> None:
        self.seq = seq
        self.detok = detok
        self.num_detok = 0  # output tokens already fed to the detokenizer
        self.text = ""  # detokenized text (cut at a matched stop string)
        self.visible = 0  # leading characters of ``text`` that are final (no pending stop-string prefix)
        self.logprobs: list[dict[int, float]] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    group: SequenceGroup
    states: list[_SeqState]
    metrics: RequestMetrics
    stop_checker: StopChecker | None
    by_seq_id: dict[int, _SeqState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_seq_id = {st.seq.seq_id: st for st in self.states}


# ---- the engine ------------------------------------------------------------------------------------------


class LLMEngine:
    """The offline/online engine core. ``LLMEngine()`` loads the default model; ``LLMEngine(model=PATH,
    **config)`` another (an HF folder or a GGUF file); keyword arguments are :class:`EngineConfig` fields."""

    def __init__(
        self, model: str | Path | None = None, *, config: EngineConfig | None = None, **kwargs: Any
    ) -> None:
        config = self._make_config(model, config, kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        from app.engine.loading import load_model  # deferred: the loader pulls in settings and safetensors

        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        loaded, tokenizer, model_config = load_model(
            config.model, dtype=dtype, device=device, cache_dir=config.model_cache_dir
        )
        self._setup(config, loaded, tokenizer, model_config, device, dtype)

    @classmethod
    def from_loaded(
        cls,
        model: PagedCausalLM,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        *,
        config: EngineConfig | None = None,
        **kwargs: Any,
    ) -> LLMEngine:
        """An engine around an already loaded model (tests, or several engines over one set of weights;
        each engine has its own KV cache and re-binds it before its forward passes)."""
        config = cls._make_config(None, config, kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        engine = cls.__new__(cls)
        weight = next(iter(model.parameters()))
        engine._setup(config, model, tokenizer, model_config, weight.device, weight.dtype)
        return engine

    @staticmethod
    def _make_config(
        model: str | Path | None, config: EngineConfig | None, kwargs: dict[str, Any]
    ) -> EngineConfig:
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; see EngineConfig")
        if config is None:
            return EngineConfig(model=model, **kwargs)
        if model is not None:
            kwargs["model"] = model
        return replace(config, **kwargs) if kwargs else config

    def _setup(
        self,
        config: EngineConfig,
        model: PagedCausalLM,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.model_name = (
            config.served_model_name or model_config.name or str(config.model or "SmolLM2-135M-Instruct")
        )
        self.vocab_size = model_config.vocab_size
        eos_ids = model_config.eos_token_ids or tokenizer.eos_token_ids
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        # The scheduler knows one eos id; the others stop a request like stop_token_ids (as in vLLM).
        self._extra_eos_ids = [int(i) for i in eos_ids[1:]]

        max_pos = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context length ({max_pos})"
            )
        budget = config.kv_cache_memory_bytes or self._default_kv_budget(device)
        num_blocks = num_blocks_for_budget(
            budget,
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
            block_size=config.block_size,
        )
        max_model_len = min(config.max_model_len or max_pos, num_blocks * config.block_size)
        spec = SpeculativeConfig.parse(config.speculative_config)
        max_batched = config.max_num_batched_tokens or (
            2048 if config.enable_chunked_prefill else max(2048, max_model_len)
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_waiting=config.max_waiting,
                policy=config.scheduling_policy,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_model_len=max_model_len,
                num_lookahead_slots=spec.num_speculative_tokens if spec else 0,
                lookahead_disable_batch_size=spec.disable_by_batch_size if spec else None,
            ),
            self.block_manager,
        )
        self.max_model_len = self.scheduler.max_model_len
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, dtype=dtype, device=device
        )
        self.sampler = Sampler(logprobs_mode=config.logprobs_mode, seed=config.seed)
        self.spec_decoder = self._make_spec_decoder(spec, num_blocks) if spec else None
        self.stats = StatsCollector()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._empty_steps = 0
        if config.warmup:
            self.runner.warmup()
            if self.spec_decoder is not None and self.spec_decoder.draft is not None:
                self.spec_decoder.draft.runner.warmup()
        log.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens (%.0f MiB), max_model_len %d",
            self.model_name,
            device,
            str(dtype).removeprefix("torch."),
            num_blocks,
            config.block_size,
            budget / (1 << 20),
            self.max_model_len,
        )

    def _make_spec_decoder(self, spec: SpeculativeConfig, num_blocks: int) -> SpeculativeDecoder:
        draft: DraftModelProposer | None = None
        if spec.method == "draft_model":
            draft_model = spec.model
            if isinstance(draft_model, str | Path):
                from app.engine.loading import load_model

                draft_model, _, _ = load_model(
                    draft_model, dtype=self.dtype, device=self.device, cache_dir=self.config.model_cache_dir
                )
            if not isinstance(draft_model, PagedCausalLM):
                raise ValueError(
                    "speculative_config 'model' must be a path or a loaded engine model (PagedCausalLM), "
                    f"got {type(draft_model).__name__}"
                )
            draft_len = draft_model.config.max_position_embeddings
            if draft_len < self.max_model_len:
                raise ValueError(
                    f"the draft model's context ({draft_len}) is shorter than max_model_len "
                    f"({self.max_model_len}); set max_model_len <= {draft_len}"
                )
            draft = DraftModelProposer(
                draft_model,
                num_blocks=num_blocks,
                block_size=self.config.block_size,
                target_vocab_size=self.vocab_size,
                dtype=self.dtype,
                device=self.device,
                sampler=self.sampler,
            )
        log.info("speculative decoding: %s", spec.describe())
        return SpeculativeDecoder(
            spec, self.runner, self.sampler, vocab_size=self.vocab_size, draft=draft, seed=self.config.seed
        )

    @staticmethod
    def _default_kv_budget(device: torch.device) -> int:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(GiB // 4, free // 2)
        return GiB

    # ---- requests ----
    @property
    def model(self) -> PagedCausalLM:
        return self.runner.model

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput | None = None,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        *,
        prompt_token_ids: Seq[int] | None = None,
    ) -> None:
        """Queue a request. ``prompt`` is text or token ids (or pass ``prompt_token_ids``).
        ``arrival_time`` is on the ``time.monotonic()`` clock. Invalid input raises ValueError and
        changes nothing; a full waiting queue raises :class:`EngineQueueFullError`."""
        text, ids = self._tokenize(prompt, prompt_token_ids)
        self._add(request_id, text, ids, sampling_params, priority, arrival_time)

    def _tokenize(
        self, prompt: PromptInput | None, prompt_token_ids: Seq[int] | None = None
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                prompt_token_ids = prompt["prompt_token_ids"]
                prompt = None
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError("pass either a prompt or prompt_token_ids, not both")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = prompt_token_ids if prompt is None else prompt
        if ids is None:
            raise ValueError("a prompt (text or token ids) is required")
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(ids).__name__}")
        return None, list(ids)

    def _add(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        sampling_params: SamplingParams | None,
        priority: int,
        arrival_time: float | None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: prompt token id {bad!r} is outside the vocabulary (size {vocab})"
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(ids)} tokens, more than the maximum "
                f"context length of {self.max_model_len}"
            )
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_params_for_vocab(params, vocab)
        if self._extra_eos_ids and not params.ignore_eos:
            extra = [t for t in self._extra_eos_ids if t not in (params.stop_token_ids or ())]
            if extra:
                params = replace(params, stop_token_ids=[*(params.stop_token_ids or ()), *extra])
        seq = Sequence(
            request_id,
            ids,
            params,
            eos_token_id=self.eos_token_id,
            priority=priority,
            arrival_time=arrival_time,
        )
        group = SequenceGroup.from_sequence(seq)
        try:
            self.scheduler.add(group)
        except QueueFullError as exc:
            raise EngineQueueFullError(str(exc)) from None
        want_logprobs = params.logprobs is not None
        states = [
            _SeqState(
                s, self.tokenizer.incremental_detokenizer(ids, params.skip_special_tokens), want_logprobs
            )
            for s in group.seqs
        ]
        stop = params.stop_strings
        self._requests[request_id] = _Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            group=group,
            states=states,
            metrics=RequestMetrics(arrival_time=seq.arrival_time, num_prompt_tokens=len(ids)),
            stop_checker=StopChecker(stop, params.include_stop_str_in_output) if stop else None,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (its blocks are freed at once); returns its final output, or None if the id is
        unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        return self._finish(req, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of the requests that progressed (cumulative)."""
        return self._step(emit_unfinished=True)

    def _step(self, emit_unfinished: bool) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            # Legitimate once (a step that only preempted); many in a row would mean a scheduler bug.
            self._empty_steps += 1
            return []
        self._empty_steps = 0
        now = time.monotonic()
        requests = self._requests
        for seq in out.scheduled:
            requests[seq.request_id].metrics.on_scheduled(now)
        results: list[list[SampleResult]]
        if self.spec_decoder is not None and out.num_lookahead_slots:
            # Proposals verified in the same pass: a sequence may get several tokens this step.
            sampling_seqs, results = self.spec_decoder.execute(out)
        else:
            logits, sampling_seqs = self.runner.execute(out)
            rows = [SamplingRow.from_sequence(s) for s in sampling_seqs]
            results = [[r] for r in self.sampler.sample(logits, rows)] if sampling_seqs else []
        before = [s.num_output_tokens for s in sampling_seqs]
        self.scheduler.update(
            out,
            {
                s.seq_id: rs[0].token_id if len(rs) == 1 else [r.token_id for r in rs]
                for s, rs in zip(sampling_seqs, results, strict=True)
            },
        )

        now = time.monotonic()
        touched: dict[str, int] = {}  # request id -> tokens it got this step
        for seq, seq_results, n0 in zip(sampling_seqs, results, before, strict=True):
            if seq.num_output_tokens == n0:
                continue  # finished or aborted before its token was applied
            req = requests[seq.request_id]
            st = req.by_seq_id[seq.seq_id]
            # Text is needed now for stop strings, streaming and finished sequences; otherwise it is
            # caught up later in one call (offline batches skip per-token detokenisation). A stop string
            # may drop tokens that landed after it in the same step.
            if req.stop_checker is not None or emit_unfinished or seq.is_finished:
                self._update_text(req, st)
            num_new = seq.num_output_tokens - n0
            if st.logprobs is not None:
                for res in seq_results[:num_new]:
                    if res.logprob is None:
                        continue
                    entry = {res.token_id: res.logprob}
                    if res.top_logprobs:
                        entry.update({k: v for k, v in res.top_logprobs.items() if k != res.token_id})
                    st.logprobs.append(entry)
                    st.cumulative_logprob = (st.cumulative_logprob or 0.0) + res.logprob
            touched[req.request_id] = touched.get(req.request_id, 0) + num_new

        outputs: list[RequestOutput] = []
        stats = self.stats
        itls: list[float] = []
        for request_id, count in touched.items():
            req = requests[request_id]
            first = req.metrics.first_token_time is None
            itl = req.metrics.on_tokens(now, count)
            if first:
                req.metrics.num_cached_tokens = req.group.parent.num_cached_tokens
                stats.record_first_token(req.metrics)
            elif itl is not None:
                itls.append(itl)
            if req.group.is_finished:
                outputs.append(self._finish(req, now))
            elif emit_unfinished:
                outputs.append(self._make_output(req))
        stats.record_step(sum(touched.values()), itls)
        return outputs

    @staticmethod
    def _stopped_by_string(seq: Sequence) -> bool:
        return seq.status is SequenceStatus.FINISHED_STOPPED and isinstance(seq.stop_reason, str)

    def _update_text(self, req: _Request, st: _SeqState) -> None:
        """Bring ``st.text`` up to the sequence's tokens and apply stop strings."""
        seq = st.seq
        if req.stop_checker is not None:
            # Several tokens can land in one step (speculative decoding). Check stop strings after each, as
            # one-token steps would, so the output ends at the token that completed a stop string.
            while seq.num_output_tokens - st.num_detok > 1 and not self._stopped_by_string(seq):
                self._update_text_to(req, st, st.num_detok + 1)
            extra = seq.num_output_tokens - st.num_detok
            if self._stopped_by_string(seq) and extra > 0:
                del seq.output_token_ids[-extra:]
                del seq.token_ids[-extra:]
        self._update_text_to(req, st, None)

    def _update_text_to(self, req: _Request, st: _SeqState, upto: int | None) -> None:
        """Detokenize the output up to ``upto`` tokens (None: all of them) and apply stop strings."""
        seq = st.seq
        if self._stopped_by_string(seq):
            st.visible = len(st.text)  # cut at its stop string: final (held-back bytes lie beyond it)
            return
        params = req.params
        ids = seq.output_token_ids
        num_output = len(ids) if upto is None else upto
        finished = seq.is_finished and num_output == len(ids)  # (earlier tokens of a finished step: not yet)
        end = num_output
        stopped_by_token = finished and seq.status is SequenceStatus.FINISHED_STOPPED
        if stopped_by_token and not params.include_stop_str_in_output:
            end -= 1  # the eos / stop token id stays in token_ids but not in the text
        delta = ""
        if end > st.num_detok:
            delta = st.detok.add(ids[st.num_detok : end])
            st.num_detok = end
        if finished:
            delta += st.detok.flush()
        if delta:
            st.text += delta
        checker = req.stop_checker
        if checker is None or (not delta and finished):
            st.visible = len(st.text)
            return
        if not delta:
            return
        if num_output >= params.min_tokens:
            found = checker.check(st.text, len(delta))
            st.text = found.text
            if found.stop is not None:
                st.visible = len(st.text)
                self._stop_on_string(seq, found.stop, num_output == len(ids))
                return
            safe = found.safe_len
        else:  # stop strings do not count before min_tokens, but a partial one is still held back
            safe = len(st.text) - (
                0 if params.include_stop_str_in_output else partial_stop_length(st.text, checker.stop)
            )
        st.visible = len(st.text) if finished else max(st.visible, safe)

    def _stop_on_string(self, seq: Sequence, stop: str, at_last_token: bool = True) -> None:
        if seq.status is SequenceStatus.FINISHED_LENGTH or (
            seq.status is SequenceStatus.FINISHED_STOPPED and not at_last_token
        ):
            # Finished by length in the same step (or by a stop token that landed after the stop string in
            # one speculative step): the stop string came first and is what the user sees, so it is the
            # reason reported (as vLLM does). Its blocks are already freed.
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        elif not seq.is_finished:
            self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, stop)

    def _make_output(self, req: _Request) -> RequestOutput:
        outs = []
        for st in req.states:
            seq = st.seq
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=st.text[: st.visible],
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=st.cumulative_logprob,
                    logprobs=list(st.logprobs) if st.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.group.is_finished,
            metrics=req.metrics.copy(),
            num_cached_tokens=req.metrics.num_cached_tokens,
        )

    def _finish(self, req: _Request, now: float) -> RequestOutput:
        for st in req.states:
            self._update_text(req, st)
            st.visible = len(st.text)
        req.metrics.finished_time = now
        self.stats.record_finished(req.metrics, [st.seq.finish_reason or "abort" for st in req.states])
        del self._requests[req.request_id]
        return self._make_output(req)

    # ---- offline API ----
    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        priority: int | Seq[int] = 0,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. ``prompts``: a string, a list of strings,
        a list of token-id lists (or vLLM's prompt dicts). ``sampling_params``: one for all, or one per
        prompt. Other requests already in the engine are advanced too (their outputs are not returned)."""
        items = [self._tokenize(p) for p in self._prompt_list(prompts)]
        return self._run(items, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Seq[Mapping[str, Any]] | Seq[Seq[Mapping[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or to a list
        of conversations, rendered with the model's chat template."""
        if not messages:
            raise ValueError("messages must not be empty")
        first = messages[0]
        conversations: list[Seq[Mapping[str, Any]]] = (
            [messages]  # type: ignore[list-item]
            if isinstance(first, Mapping)
            else list(messages)  # type: ignore[arg-type]
        )
        items: list[tuple[str | None, list[int]]] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            # The template writes the special tokens itself (BOS included where the model has one).
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm, 0)

    @staticmethod
    def _prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, str | Mapping):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [items]  # type: ignore[list-item]  # one prompt given as token ids
        return items  # type: ignore[return-value]

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool,
        priority: int | Seq[int],
    ) -> list[RequestOutput]:
        n = len(items)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list: list[SamplingParams | None] = [sampling_params] * n
        else:
            params_list = list(sampling_params)
            if len(params_list) != n:
                raise ValueError(
                    f"{len(params_list)} sampling_params for {n} prompts: pass one, or one per prompt"
                )
        priorities = [priority] * n if isinstance(priority, int) else list(priority)
        if len(priorities) != n:
            raise ValueError(f"{len(priorities)} priorities for {n} prompts")
        ids: list[str] = []
        try:
            for (text, tokens), params, prio in zip(items, params_list, priorities, strict=True):
                request_id = f"generate-{next(self._ids)}"
                self._add(request_id, text, tokens, params, prio, None)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:  # all or nothing: the engine is left as it was
                self.abort_request(request_id)
            raise
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = _progress(n) if use_tqdm else None
        try:
            while pending:
                outputs = self._step(emit_unfinished=False)
                for output in outputs:
                    if output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
                if self._empty_steps > _MAX_EMPTY_STEPS:
                    raise RuntimeError(
                        f"the scheduler made no progress on {len(pending)} pending requests "
                        f"in {self._empty_steps} steps"
                    )
        except BaseException:
            for request_id in pending:
                self.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[request_id] for request_id in ids]

    # ---- stats ----
    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return self.stats.snapshot(
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            kv_cache_usage_perc=s.kv_cache_usage_perc,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            spec_decode=self.spec_decoder.stats.copy() if self.spec_decoder is not None else None,
        )


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="Generating", unit="req")
