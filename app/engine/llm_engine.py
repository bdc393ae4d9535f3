"""``LLMEngine``: the synchronous engine loop, in vLLM's shape.

One :meth:`LLMEngine.step` advances every scheduled sequence by one model pass: the scheduler decides what
runs (continuous batching, chunked prefill, preemption), the model runner computes the logits (or the
speculative decoder proposes and verifies several tokens), the sampler picks tokens, the scheduler applies
them (length, eos and stop-token stops), and the :class:`~app.engine.output_processor.OutputProcessor`
turns token ids into text, applies stop strings and builds :class:`RequestOutput` objects. Prompts come in
through the :class:`~app.engine.input_processor.InputProcessor` (tokenising and validation).

Structured outputs (``SamplingParams.structured_outputs``): ``add_request`` compiles the grammar (cached; a
ValueError for an invalid or too large spec), each sequence gets its own matcher, every step fills the
allowed-token bitmask of the constrained rows and the sampler applies it, and the update advances the
matchers with the appended tokens (see :mod:`app.engine.guided`).

Not thread-safe: one thread drives an engine (``AsyncEngine`` serialises access for servers).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

import app.engine.kernels.library as library
from app.engine.attention import AttentionMetadata
from app.engine.config import ModelConfig
from app.engine.core.admission import BatchingStrategyName, check_batching_strategy
from app.engine.core.block_manager import BlockManager, num_blocks_for_budget
from app.engine.core.eviction import EvictionPolicyName, check_eviction_policy, check_ttl
from app.engine.core.sampling_params import SamplingParams
from app.engine.core.scheduler import QueueFullError, Scheduler, SchedulerConfig
from app.engine.core.sequence import Sequence
from app.engine.frameworks import FrameworkRunner, build_runner, check_framework
from app.engine.guided.matcher import GuidedDecoding
from app.engine.hidden_states import attach as attach_captures
from app.engine.hidden_states import check_hidden_state_params
from app.engine.input_processor import InputProcessor, PromptInput, TokenizedPrompt
from app.engine.kernels.attention import bf16_attention_supported
from app.engine.metrics import EngineStats, StatsCollector
from app.engine.model_runner import ModelRunner
from app.engine.models.base import PagedCausalLM
from app.engine.models.llama import LlamaForCausalLM
from app.engine.models.quantization import (
    CALIBRATION_TEXT,
    QUANTIZATIONS,
    auto_block_rows,
    auto_int8_products,
    check_quantization,
    install_w8a8,
    memory_available,
    quantize_model,
    settle_w8a8,
    w8a8_pending,
)
from app.engine.output_processor import OutputProcessor
from app.engine.outputs import RequestOutput
from app.engine.sampler import LogprobsMode, Sampler, SampleResult, SamplingRow
from app.engine.spec_decode import DraftModelProposer, SpeculativeConfig, SpeculativeDecoder
from app.engine.tokenizer import Tokenizer

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


class EngineQueueFullError(QueueFullError):
    """The bounded waiting queue (``max_waiting``) is full: shed load (HTTP 429/503) and retry later."""


@dataclass
class EngineConfig:
    """Everything that shapes an engine; ``LLMEngine(**kwargs)`` takes the same names."""

    model: str | Path | None = None  # None: the default SmolLM2-135M-Instruct
    # The model runner's framework (app.engine.frameworks): "torch" (the engine's own), "jax" or "tinygrad"
    # (float32 on CPU, weights taken from the loaded PyTorch model; pip install 'inf-engine[jax]' or [tinygrad])
    framework: str = "torch"
    # "auto": the checkpoint's precision where this device runs it natively: bfloat16 on CUDA and, for a 16-bit
    # or quantized checkpoint (GGUF), on a CPU with AVX512-BF16; float32 otherwise. bfloat16 on CPU means
    # bfloat16 weights and products, float32 activations (see app.engine.models.base.compute_dtype_for).
    dtype: str | torch.dtype = "auto"
    # "auto": the activations' dtype, but bfloat16 under bfloat16 weights on a CPU with AVX512-BF16 (its attention
    # reads bfloat16 values); or "float32" / "bfloat16"
    kv_cache_dtype: str = "auto"
    # Weight-only quantization of the matrix products (app.engine.models.quantization): None picks per CPU class
    # (a GGUF model keeps its blocks for few-row steps beside float32 or bfloat16 weights, and float32 weights
    # run the larger steps as int8 products on a CPU with AVX512-VNNI, see install_w8a8); "none" keeps the
    # loaded weights; "int8" or "gguf" for every step
    quantization: str | None = None
    device: str | torch.device = "auto"  # "auto": CUDA when available
    block_size: int = 16
    # KV-cache budget in bytes; None: 1 GiB on CPU, 50% of the free memory after loading on CUDA.
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    # Token budget of one step; None: 2048, or max_model_len if larger and prefill cannot be chunked.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's context length (capped by the KV cache)
    enable_prefix_caching: bool = True
    # Which free cached KV block gives way to a fresh one, and how long an unused cached prefix is kept
    # (seconds; None: until evicted). See app.engine.core.eviction.
    kv_cache_eviction_policy: EvictionPolicyName = "lru"
    prefix_cache_ttl_s: float | None = None
    # Which waiting requests a step admits (app.engine.core.admission); bucketed groups prompts by length.
    batching_strategy: BatchingStrategyName = "continuous"
    batching_bucket_size: int = 128
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
    # True: never replay decode steps from CUDA graphs (vLLM's name); they are used on CUDA otherwise.
    enforce_eager: bool = False
    # Speculative decoding (vLLM's keys): {"method": "ngram", "num_speculative_tokens": 4, ...} or
    # {"method": "draft_model", "model": PATH_OR_LOADED_MODEL, ...}; a dict, a JSON string or a
    # SpeculativeConfig. None: off.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        check_eviction_policy(self.kv_cache_eviction_policy)
        check_ttl(self.prefix_cache_ttl_s)
        check_batching_strategy(self.batching_strategy)
        for name in ("block_size", "max_num_seqs", "batching_bucket_size"):
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
        check_quantization(self.quantization)
        check_framework(self.framework)
        if self.framework != "torch":
            self._check_framework_options()
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', got {self.kv_cache_dtype!r}"
            )

    def _check_framework_options(self) -> None:
        """The jax and tinygrad runners compute in float32 on CPU, with one sampling pass per step."""
        name = self.framework
        if self.bfloat16_products():
            self._check_bfloat16_products()
        elif self.dtype not in ("auto", "float32", torch.float32):
            raise ValueError(f"framework {name!r} runs in float32 (jax also in bfloat16): give dtype 'auto' or "
                             f"'float32', not {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32"):
            raise ValueError(f"framework {name!r} keeps a float32 KV cache: give kv_cache_dtype 'auto' or 'float32'")
        if self.quantization not in (None, "none"):
            raise ValueError(f"framework {name!r} runs float32 weights: quantization {self.quantization!r} is "
                             "for the torch framework")
        if self.device not in ("auto", "cpu") and str(self.device) != "cpu":
            raise ValueError(f"framework {name!r} runs on the CPU here: give device 'auto' or 'cpu'")
        if self.speculative_config is not None:
            raise ValueError(f"speculative decoding runs on the torch framework only, not {name!r}")

    def bfloat16_products(self) -> bool:
        """The jax runner's opt-in: ``dtype`` bfloat16 makes its matrix products bfloat16 x bfloat16 with float32
        sums (weights stored in bfloat16); everything else stays float32."""
        return self.framework == "jax" and self.dtype in ("bfloat16", torch.bfloat16)

    def _check_bfloat16_products(self) -> None:
        from app.engine.kernels.cpu_features import bf16_products_supported

        if not bf16_products_supported():
            raise ValueError("framework 'jax' runs bfloat16 products only on a CPU with AVX512-BF16 or AMX (elsewhere "
                             "they are slower than float32): give dtype 'float32'")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    def resolve_device(self) -> torch.device:
        if self.framework != "torch":
            return torch.device("cpu")
        if isinstance(self.device, torch.device):
            return self.device
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
        """The weights' dtype; ``checkpoint`` is the precision the checkpoint was saved in (None: unknown)."""
        if self.framework != "torch":  # the framework runners copy float32 weights (jax may round products')
            return torch.float32
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16
        from app.engine.kernels.cpu_features import bf16_products_supported

        sixteen_bit = checkpoint in (torch.bfloat16, torch.float16)
        return torch.bfloat16 if sixteen_bit and bf16_products_supported() else torch.float32

    def resolve_kv_cache_dtype(
        self, dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device | None = None
    ) -> torch.dtype:
        """ "auto": the activations' dtype, except for bfloat16 weights on a CPU with AVX512-BF16, whose
        attention reads keys and values as bfloat16 values (q, K, V rounded, as a bfloat16 SDPA has them): there
        a bfloat16 cache holds exactly what is read, at half the bytes, as vLLM's "auto" does."""
        if self.kv_cache_dtype != "auto":
            return _DTYPES[self.kv_cache_dtype]
        on_cpu = device is None or torch.device(device).type == "cpu"
        if on_cpu and dtype == torch.bfloat16 and bf16_attention_supported():
            return torch.bfloat16
        return compute_dtype


# ---- the engine ------------------------------------------------------------------------------------------
def scheduler_config(config: EngineConfig, max_pos: int, num_blocks: int,
                     spec: SpeculativeConfig | None) -> SchedulerConfig:
    """The scheduler's limits: the context length the model and the KV cache allow, the step's token budget."""
    max_model_len = min(config.max_model_len or max_pos, num_blocks * config.block_size)
    max_batched = config.max_num_batched_tokens or (
        2048 if config.enable_chunked_prefill else max(2048, max_model_len)
    )
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_waiting=config.max_waiting,
        policy=config.scheduling_policy,
        enable_chunked_prefill=config.enable_chunked_prefill,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_model_len=max_model_len,
        num_lookahead_slots=spec.num_speculative_tokens if spec else 0,
        lookahead_disable_batch_size=spec.disable_by_batch_size if spec else None,
        batching_strategy=config.batching_strategy,
        batching_bucket_size=config.batching_bucket_size,
    )


def _auto_blocks(model: PagedCausalLM, source: str | Path | None, device: torch.device, dtype: torch.dtype) -> None:
    """Quantization "auto": a GGUF model with float32 or bfloat16 weights on CPU keeps the file's blocks beside
    them (its Q4 layers and its Q8_0 LM head), for the steps of few rows (:func:`auto_block_rows`), where
    memory allows; the load log says which it chose."""
    from app.engine.kernels.matmul import bf16_matmul_supported
    from app.engine.kernels.qblock import qblock_isa
    from app.engine.loading import apply_quantization, default_model_path
    from app.engine.loading.gguf import is_gguf_file

    path = default_model_path() if source is None else Path(source).expanduser()
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return
    bf16_products = dtype == torch.bfloat16 and bf16_matmul_supported()
    isa = qblock_isa() if library.available() else None
    rows = auto_block_rows(isa, bf16_products)
    if rows is None or not is_gguf_file(path):
        return
    weights = sum(p.numel() for p in model.parameters())
    free = memory_available()
    if free is not None and free < weights:  # the blocks take about 0.6 bytes a weight: ask for 1 byte free
        log.info("quantization auto: %s weights only (%.0f MiB available, too little to keep %s's blocks "
                 "beside them)", _dtype_name(dtype), free / (1 << 20), path.name)
        return
    count = apply_quantization(model, "gguf", path, beside_float_rows=rows)
    if not count:
        return
    larger = _dtype_name(dtype)
    if dtype == torch.float32 and auto_int8_products(isa) and (free is None or free >= 2 * weights):
        install_w8a8(model)  # a CPU without bfloat16 products: int8 products beat float32's for many rows
        larger = "int8 products (float32 weights rounded to int8 per channel, activations per row)"
    log.info("quantization auto: %s's blocks kept beside the %s weights (%d linear layers and the LM head): "
             "steps of up to %d rows run on the blocks, larger ones on %s (set quantization 'none' or "
             "'gguf' to keep one)", path.name, _dtype_name(dtype), count, rows, larger)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _make_runner(config: EngineConfig, model: PagedCausalLM, model_config: ModelConfig, num_blocks: int,
                 kv_cache_dtype: torch.dtype, device: torch.device, scheduler: Scheduler) -> ModelRunner | FrameworkRunner:
    """The engine's own PyTorch runner, or the jax / tinygrad one (app.engine.frameworks)."""
    if config.framework != "torch":
        return build_runner(config.framework, model, model_config, num_blocks=num_blocks,
                            block_size=config.block_size, max_model_len=scheduler.max_model_len,
                            max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
                            bfloat16_products=config.bfloat16_products())
    return ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size, dtype=kv_cache_dtype,
                       device=device, cuda_graphs=not config.enforce_eager, max_graph_batch=config.max_num_seqs,
                       max_model_len=scheduler.max_model_len)


def _engine_config(
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


class LLMEngine:
    """The offline/online engine core. ``LLMEngine()`` loads the default model; ``LLMEngine(model=PATH,
    **config)`` another (an HF folder or a GGUF file); keyword arguments are :class:`EngineConfig` fields."""

    def __init__(
        self, model: str | Path | None = None, *, config: EngineConfig | None = None, **kwargs: Any
    ) -> None:
        config = _engine_config(model, config, kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        from app.engine.loading import (  # deferred: pulls in settings, safetensors
            apply_quantization,
            checkpoint_dtype,
            load_model,
        )

        device = config.resolve_device()
        dtype = config.resolve_dtype(device, checkpoint_dtype(config.model))
        loaded, tokenizer, model_config = load_model(
            config.model, dtype=dtype, device=device, cache_dir=config.model_cache_dir
        )
        if config.quantization in QUANTIZATIONS:
            apply_quantization(loaded, config.quantization, config.model)
        elif config.quantization is None and config.framework == "torch":
            _auto_blocks(loaded, config.model, device, dtype)
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
        config = _engine_config(None, config, kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        engine = cls.__new__(cls)
        if config.quantization in QUANTIZATIONS:  # in place: engines sharing this model share its quantized weights
            quantize_model(model, config.quantization)
        weight = model.lm_head_weight()
        engine._setup(config, model, tokenizer, model_config, weight.device, weight.dtype)
        return engine

    # ---- construction: KV sizing, scheduler, runner, sampler, processors ----
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
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(dtype, model.compute_dtype, device)
        self.model_name = (
            config.served_model_name or model_config.name or str(config.model or "SmolLM2-135M-Instruct")
        )
        self.vocab_size = model_config.vocab_size
        eos_ids = model_config.eos_token_ids or tokenizer.eos_token_ids
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None

        budget, num_blocks = self._size_kv_cache()
        spec = SpeculativeConfig.parse(config.speculative_config)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            eviction_policy=config.kv_cache_eviction_policy,
            prefix_cache_ttl_s=config.prefix_cache_ttl_s,
        )
        limits = scheduler_config(config, model_config.max_position_embeddings, num_blocks, spec)
        self.scheduler = Scheduler(limits, self.block_manager)
        self.max_model_len = self.scheduler.max_model_len
        self.framework = config.framework
        self._model = model
        self.runner = _make_runner(config, model, model_config, num_blocks, self.kv_cache_dtype, device,
                                   self.scheduler)
        if isinstance(self.runner, ModelRunner) and w8a8_pending(model):
            self._calibrate_int8(self.runner, num_blocks)
        self.sampler = Sampler(logprobs_mode=config.logprobs_mode, seed=config.seed)
        self.guided = GuidedDecoding(tokenizer, self.vocab_size, eos_ids, max_model_len=self.max_model_len)
        self.spec_decoder = self._make_spec_decoder(spec, num_blocks) if spec else None
        if self.spec_decoder is not None:
            self.spec_decoder.guide = self.guided.bitmask_for
        self.stats = StatsCollector()
        self.input_processor = InputProcessor(
            tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len, eos_token_ids=eos_ids
        )
        self.output_processor = OutputProcessor(tokenizer, self.scheduler.finish_sequence, self.stats)
        self._ids = itertools.count()
        self._empty_steps = 0
        if config.warmup:
            self.runner.warmup()
            if self.spec_decoder is not None and self.spec_decoder.draft is not None:
                self.spec_decoder.draft.runner.warmup()
        log.info(
            "engine ready: %s on %s/%s (%s), %d KV blocks of %d tokens (%.0f MiB), max_model_len %d, max_num_seqs %d, "
            "max_num_batched_tokens %d, prefix caching %s",
            self.model_name,
            device,
            str(dtype).removeprefix("torch."),
            config.framework,
            num_blocks,
            config.block_size,
            budget / (1 << 20),
            self.max_model_len,
            config.max_num_seqs,
            self.scheduler.config.max_num_batched_tokens,
            "on" if config.enable_prefix_caching else "off",
        )

    def _size_kv_cache(self) -> tuple[int, int]:
        """The KV-cache budget in bytes and the number of blocks that fit it."""
        config, model_config = self.config, self.model_config
        max_pos = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context length ({max_pos}): give at "
                f"most {max_pos}, or leave it unset"
            )
        budget = config.kv_cache_memory_bytes or self._default_kv_budget(self.device)
        return budget, num_blocks_for_budget(
            budget,
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype_bytes=torch.empty((), dtype=self.kv_cache_dtype).element_size(),
            block_size=config.block_size,
        )

    def _calibrate_int8(self, runner: ModelRunner, num_blocks: int) -> None:
        """Run CALIBRATION_TEXT once through the model (a prefill into KV blocks no request holds yet) so that
        the int8 products know which input channels to keep in float32 (quantization "auto", see Int8Weight)."""
        block = runner.block_size
        ids = self.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)[: (num_blocks - 1) * block]
        if ids:
            meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(-(-len(ids) // block)))], block)
            with torch.inference_mode():
                hidden = self._model(
                    torch.tensor(ids, device=self.device), torch.arange(len(ids), device=self.device), meta
                )
                self._model.compute_logits(hidden)  # the LM head's input too
        settle_w8a8(self._model)

    def _make_spec_decoder(self, spec: SpeculativeConfig, num_blocks: int) -> SpeculativeDecoder:
        draft: DraftModelProposer | None = None
        if spec.method == "draft_model":
            draft = DraftModelProposer.from_config(
                spec,
                max_model_len=self.max_model_len,
                num_blocks=num_blocks,
                block_size=self.config.block_size,
                target_vocab_size=self.vocab_size,
                dtype=self.dtype,
                device=self.device,
                sampler=self.sampler,
                cache_dir=self.config.model_cache_dir,
            )
        log.info("speculative decoding: %s", spec.describe())
        assert isinstance(self.runner, ModelRunner)  # EngineConfig allows speculation on the torch framework only
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
        return self._model

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
        text, ids = self.input_processor.tokenize(prompt, prompt_token_ids)
        self._add(request_id, text, ids, sampling_params, priority, arrival_time)

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
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = self.input_processor.make_group(request_id, ids, sampling_params, priority, arrival_time)
        check_hidden_state_params(group.parent.sampling_params, self.model_config, supported=(
            self.spec_decoder is None and self.framework == "torch" and isinstance(self._model, LlamaForCausalLM)))
        spec = group.parent.sampling_params.structured_outputs
        compiled = self.guided.compile(spec) if spec is not None else None  # ValueError: nothing added
        try:
            self.scheduler.add(group)
        except QueueFullError as exc:
            raise EngineQueueFullError(str(exc)) from None
        if compiled is not None:
            self.guided.add_request(request_id, group.seqs, compiled)
        self.output_processor.add_request(request_id, text, ids, group)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (its blocks are freed at once); returns its final output, or None if the id is
        unknown or already finished."""
        if request_id not in self.output_processor:
            return None
        self.scheduler.abort(request_id)
        self.guided.release(request_id)
        self.runner.captures.discard(request_id)
        return self.output_processor.finish_request(request_id, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the outputs of the requests that progressed (cumulative)."""
        return self._step(emit_unfinished=True)

    def _step(self, emit_unfinished: bool) -> list[RequestOutput]:
        """schedule → execute → sample → update → process outputs."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:  # legitimate once (a step that only preempted); many in a row: a scheduler bug
            self._empty_steps += 1
            return []
        self._empty_steps = 0
        self.output_processor.on_scheduled(scheduled.scheduled, time.monotonic())
        if self.spec_decoder is not None and scheduled.num_lookahead_slots:
            seqs, results = self.spec_decoder.execute(scheduled)  # proposals verified in the same pass
        else:
            logits, seqs = self.runner.execute(scheduled)
            results = self._sample(logits, seqs)
        num_before = [s.num_output_tokens for s in seqs]
        self.scheduler.update(scheduled, _sampled_token_ids(seqs, results))
        if len(self.guided):
            self.guided.advance(seqs, num_before, self.scheduler.finish_sequence)
        outputs = self.output_processor.process(seqs, results, num_before, emit_unfinished=emit_unfinished)
        if len(self.guided):
            for output in outputs:
                if output.finished:
                    self.guided.release(output.request_id)
        if len(self.runner.captures):
            for output in outputs:
                if output.finished:
                    attach_captures(output, self.runner.captures)
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[list[SampleResult]]:
        if not seqs:
            return []
        rows = [SamplingRow.from_sequence(s) for s in seqs]
        return [[r] for r in self.sampler.sample(logits, rows, self.guided.bitmask_for(seqs))]

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
        inputs = self.input_processor
        items = [inputs.tokenize(p) for p in inputs.prompt_list(prompts)]
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
        items = self.input_processor.render_chats(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt
        )
        return self._run(items, sampling_params, use_tqdm, 0)

    def _run(
        self,
        items: list[TokenizedPrompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool,
        priority: int | Seq[int],
    ) -> list[RequestOutput]:
        ids = self._add_all(items, sampling_params, priority)
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            while pending:
                for output in self._step(emit_unfinished=False):
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

    def _add_all(
        self,
        items: list[TokenizedPrompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        priority: int | Seq[int],
    ) -> list[str]:
        """Add one request per prompt, all or nothing; returns their ids in order."""
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
        return ids

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
            eviction_policy=s.eviction_policy,
            prefix_cache_evictions=s.prefix_cache_evictions,
            prefix_cache_expirations=s.prefix_cache_expirations,
            spec_decode=self.spec_decoder.stats.copy() if self.spec_decoder is not None else None,
        )


def _sampled_token_ids(seqs: list[Sequence], results: list[list[SampleResult]]) -> dict[int, int | list[int]]:
    """What ``Scheduler.update`` takes: seq id -> its sampled token, or its tokens when it got several."""
    return {
        s.seq_id: rs[0].token_id if len(rs) == 1 else [r.token_id for r in rs]
        for s, rs in zip(seqs, results, strict=True)
    }


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="Generating", unit="req")
