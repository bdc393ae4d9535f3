"""Paged attention in plain PyTorch: the KV cache, the per-step metadata and the attention op.

One forward step runs ONE flat batch of tokens: prefill chunks and single-token decodes of many sequences laid
end to end (``cu_seqlens_q`` marks where each sequence's queries start). Each sequence's keys and values live in
fixed-size blocks of a per-layer cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; its block table
lists the physical blocks in order, so logical position ``p`` is slot ``table[p // block_size] * block_size +
p % block_size``.

The metadata builds, once per step (some of it on first use), everything the layers share (gather indices,
masks), so a layer does only tensor work: write the new K/V by ``slot_mapping``, then

* sequences with one query token (decodes, and any 1-token chunk) on CPU float32 go to the C kernel
  ``app.engine.kernels.paged_decode_attention``, which reads each sequence's K/V in place through its block
  table. Elsewhere (CUDA, bfloat16, no compiler) they run through batched SDPA calls over their
  gathered blocks with a padding mask. Grouped-query heads ride in the query-length axis, so K/V are never
  repeated. Decodes are sorted by context length and cut into a few groups when that saves padded work (a
  short sequence batched with a long one would otherwise attend over the long one's padding);
* on that same C path, a sequence with a few query tokens (at most ``SHORT_QUERY_MAX``: a speculative
  verification, a tiny chunk) becomes one kernel entry per token, token ``t`` seeing positions ``<= ctx_len -
  q_len + t``: it reads its cache in place instead of gathering it, and each position's numbers are exactly
  those a plain decode of that position computes;
* the other multi-token sequences (prompts, chunks, prefix-cache hits) go, on CPU float32, to the C kernel
  ``app.engine.kernels.paged_prefill_attention``, all in one call: it reads their K/V in place and gives a
  query row the same arithmetic however the prompt was split, so prefix caching and chunked prefill are exact;
* elsewhere, a sequence with several query tokens and nothing cached attends to its own new K/V with
  ``is_causal``, and any other (chunked prefill, prefix-cache hit) gathers its context and uses a causal mask
  offset by the cached prefix: query ``i`` sits at position ``ctx_len - q_len + i`` and sees keys ``<=`` it.

Gathered K/V go into a reusable :class:`AttentionWorkspace`: a fresh multi-megabyte tensor per layer per step
costs more in page faults than the copy itself.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from app.engine.config import ModelConfig
from app.engine.kernels import paged_decode_attention, paged_prefill_attention
from app.engine.kernels import write_kv as write_kv_in_place

# Sequences with at most this many query tokens go to the C decode kernel, one entry per token (it reads a
# sequence's K/V once per token, which beats a gather plus SDPA only while the tokens are few).
SHORT_QUERY_MAX = 8
# Decode batches are split by context length into at most this many SDPA calls...
MAX_DECODE_GROUPS = 4
# ...and only when a split saves at least this fraction of the padded key slots.
_MIN_GROUP_SAVING = 0.15


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """One zeroed allocation, returned as per-layer views ``[2, num_blocks, block_size, kv_heads, head_dim]``.

    Zeroed, not empty: padded positions are masked with -inf, but ``0 * NaN`` from uninitialised memory would
    still poison ``softmax @ V``. On CPU the memory is an anonymous mapping, which the OS zero-fills page by
    page on first touch: a block costs RAM only once a sequence has used it, so the budget is a ceiling rather
    than an up-front cost (``torch.zeros`` would write, and so commit, every page at start-up).
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if torch.device(device).type == "cpu":
        full = zeroed_mapping(shape, dtype)
    else:
        full = torch.zeros(shape, dtype=dtype, device=device)
    return list(full.unbind(0))


def zeroed_mapping(shape: tuple[int, ...], dtype: torch.dtype, *, huge_pages: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor on its own anonymous mapping, committed page by page on first touch; ``huge_pages``
    asks Linux for 2 MB pages (see :func:`_ask_for_huge_pages`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private, as ordinary memory is (a forked process gets a copy-on-write view, not a shared cache).
    # The tensor keeps the mapping alive; it is unmapped when the last view is freed.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE") else mmap.mmap(-1, nbytes)
    if huge_pages:
        _ask_for_huge_pages(buf)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _ask_for_huge_pages(buf: mmap.mmap) -> None:
    """Back the mapping with 2 MB pages where Linux allows it (transparent huge pages in ``madvise`` mode, as
    many distributions ship it, or ``always``); a no-op where the call or the flag does not exist.

    Not used for the KV cache. Its decode attention kernel ran 1.1-1.2x faster on 2 MB pages (fewer TLB misses
    on scattered blocks: ``scripts/bench_decode_attention.py --pages``), but the engine touches fresh blocks
    all along (cached ones are kept while empty ones remain), and a first touch of a 2 MB page cost 1.5-6.5x
    more per byte than of 4 KB ones on the test machine (likely the kernel compacting memory to make the page):
    on a benchmark run that outweighed the gain."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(buf, "madvise"):
        return
    with contextlib.suppress(OSError):  # huge pages disabled ("never") or not built into this kernel
        buf.madvise(advice)


class AttentionWorkspace:
    """Grow-only scratch buffers for gathered K/V, reused by every layer and step of one model."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, row_numel: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[rows, row_numel]`` view of buffer ``name`` (contents undefined)."""
        need = rows * row_numel
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            # 25% headroom so a slowly growing context does not reallocate every step.
            buf = torch.empty(need + need // 4, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:need].view(rows, row_numel)


@dataclass
class _DecodeGroup:
    """Single-query sequences attended together: one gather and one SDPA call per layer."""

    rows: torch.Tensor | None  # their query rows in the flat batch; None = all rows, in order
    block_ids: torch.Tensor  # [n * blocks_per_seq] physical blocks to gather
    mask: torch.Tensor  # [n, 1, 1, width] bool: True where a key exists, False on padding
    width: int  # gathered key slots per sequence (blocks_per_seq * block_size)


@dataclass
class _DecodeIndex:
    """The C kernel's entries: every single-query sequence, and one entry per query token of a short one."""

    rows: torch.Tensor | None  # their query rows in the flat batch; None = all rows, in order
    block_tables: torch.Tensor  # [n, blocks] int64, valid block ids (padding points at block 0)
    context_lens: torch.Tensor  # [n] int64: the positions an entry's query sees
    max_context_len: int


@dataclass
class StaticDecode:
    """A decode-only step laid out in fixed-shape buffers (a CUDA graph replays it): every sequence reads
    ``width`` key slots through its row of ``block_tables`` and masks those at or past ``context_lens``.

    Its attention is plain tensor work (gather, compare, SDPA) with no host-side indexing, so a graph
    captured once serves every step whose batch and context fit its shape."""

    block_tables: torch.Tensor  # [B, width // block_size] int64 (padding rows point at a scratch block)
    context_lens: torch.Tensor  # [B] int64
    width: int


@dataclass
class _PrefillSeq:
    """One multi-token sequence of the batch; its gather indices and mask are built on first use (a short
    sequence that the C kernel serves never needs them)."""

    start: int  # first query row in the flat batch
    q_len: int
    ctx_len: int
    table: torch.Tensor | None  # its block-table row when part of its context is cached; None: new K/V only
    block_size: int
    seq: int  # its index in the batch (its row of the block tables)
    in_decode_index: bool = False  # its tokens are also C-kernel entries (used when the kernel applies)

    @cached_property
    def block_ids(self) -> torch.Tensor | None:
        """The blocks holding its context; None when nothing is cached (attend to the new K/V)."""
        if self.table is None:
            return None
        return self.table[: -(-self.ctx_len // self.block_size)].contiguous()

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """``[q_len, ctx_len]`` bool, True = may attend: query ``i`` sits at position ``ctx_len - q_len + i``."""
        if self.table is None:
            return None
        device = self.table.device
        qpos = torch.arange(self.ctx_len - self.q_len, self.ctx_len, device=device)
        return torch.arange(self.ctx_len, device=device)[None, :] <= qpos[:, None]


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat batch; built once by the model runner, shared by every layer.

    ``query_lens[i]`` new tokens of sequence ``i`` are in the batch; ``context_lens[i]`` counts its cached plus
    new tokens. ``slot_mapping[t]`` is the physical cache slot of new token ``t``. ``block_tables`` is ``[B,
    max_blocks]``, padded with -1 (or any id: padding past a sequence's context is never read unmasked).
    """

    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    cu_seqlens_q: torch.Tensor = field(init=False)
    num_tokens: int = field(init=False)
    max_query_len: int = field(init=False)
    max_context_len: int = field(init=False)
    # Set by the model for the duration of its forward (scratch for gathers); None allocates per call.
    workspace: AttentionWorkspace | None = field(default=None, repr=False)
    decode_index: _DecodeIndex | None = field(init=False, default=None, repr=False)
    # A bfloat16 model on a CPU with AVX512-BF16: the C kernels attend to bfloat16 values (q, K and V rounded,
    # as a bfloat16 SDPA has them), scores by bfloat16 products, float32 weights and sums.
    bf16_products: bool = False
    # Set by the CUDA-graph runner: the fixed-shape decode layout its graphs replay (see StaticDecode).
    static_decode: StaticDecode | None = field(default=None, repr=False)
    # Set by the model runner for a step with captures or interventions (app.engine.hidden_states.StepHooks)
    hooks: Any = field(default=None, repr=False)
    prefills: list[_PrefillSeq] = field(init=False, default_factory=list, repr=False)
    _decode_groups: list[_DecodeGroup] | None = field(init=False, default=None, repr=False)
    _cu: list[int] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.query_lens = [int(q) for q in self.query_lens]
        self.context_lens = [int(c) for c in self.context_lens]
        n = len(self.query_lens)
        if n == 0:
            raise ValueError("AttentionMetadata needs at least one sequence")
        if len(self.context_lens) != n:
            raise ValueError(f"{n} query_lens but {len(self.context_lens)} context_lens")
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if q <= 0 or c < q:
                raise ValueError(f"sequence {i}: need 0 < query_len <= context_len, got {q} and {c}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != n:
            raise ValueError(f"block_tables must be [{n}, max_blocks], got {tuple(self.block_tables.shape)}")
        need = -(-max(self.context_lens) // self.block_size)
        if self.block_tables.shape[1] < need:
            raise ValueError(f"block_tables has {self.block_tables.shape[1]} columns, context needs {need}")
        self.num_tokens = sum(self.query_lens)
        if self.slot_mapping.shape != (self.num_tokens,):
            raise ValueError(
                f"slot_mapping must be [{self.num_tokens}], got {tuple(self.slot_mapping.shape)}"
            )
        self.slot_mapping = self.slot_mapping.long()
        self.block_tables = self.block_tables.long()
        cu = [0]
        for q in self.query_lens:
            cu.append(cu[-1] + q)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.long, device=self.slot_mapping.device)
        self.max_query_len = max(self.query_lens)
        self.max_context_len = max(self.context_lens)
        self._prepare(cu)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from Python lists; computes ``slot_mapping`` for the new tokens of each sequence."""
        if len(block_tables) != len(query_lens) or len(context_lens) != len(query_lens):
            raise ValueError(
                f"{len(query_lens)} query_lens, {len(context_lens)} context_lens and "
                f"{len(block_tables)} block tables: need one of each per sequence"
            )
        slots: list[int] = []
        for table, q, c in zip(block_tables, query_lens, context_lens, strict=True):
            if -(-c // block_size) > len(table):
                raise ValueError(f"context of {c} tokens needs more than the {len(table)} blocks given")
            for pos in range(c - q, c):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [-1] * (width - len(t)) for t in block_tables]
        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            block_size=block_size,
        )

    @property
    def decode_groups(self) -> list[_DecodeGroup]:
        """The single-query sequences cut into SDPA calls (built on first use: the C kernel needs none)."""
        if self._decode_groups is None:
            self._decode_groups = self._build_decode_groups()
        return self._decode_groups

    def _prepare(self, cu: list[int]) -> None:
        bs = self.block_size
        self._cu = cu
        # Padding entries may be -1: point them at block 0; the masks (or context lengths) hide it.
        tables = self.block_tables.clamp(min=0)
        self.block_tables = tables
        short = {i for i, q in enumerate(self.query_lens) if 1 < q <= SHORT_QUERY_MAX}
        self.decode_index = self._kernel_index(tables, cu, short)
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if q == 1:
                continue
            self.prefills.append(_PrefillSeq(cu[i], q, c, None if c == q else tables[i], bs, i, i in short))

    def _kernel_index(self, tables: torch.Tensor, cu: list[int], short: set[int]) -> _DecodeIndex | None:
        """The C kernel's entries: each decode, and each token of the ``short`` sequences, in row order."""
        seqs: list[int] = []
        ctx: list[int] = []
        rows: list[int] = []
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if q != 1 and i not in short:
                continue
            for t in range(q):  # token t of the sequence's new ones sits at position c - q + t
                seqs.append(i)
                ctx.append(c - q + 1 + t)
                rows.append(cu[i] + t)
        if not seqs:
            return None
        device = self.slot_mapping.device
        nblocks = -(-max(ctx) // self.block_size)
        if self.is_decode_only:  # one entry per sequence, in batch order
            entry_rows, entry_tables = None, tables[:, :nblocks]
        else:
            entry_rows = torch.tensor(rows, dtype=torch.long, device=device)
            index = torch.tensor(seqs, dtype=torch.long, device=device)
            entry_tables = tables.index_select(0, index)[:, :nblocks]
        return _DecodeIndex(
            entry_rows,
            entry_tables.contiguous(),
            torch.tensor(ctx, dtype=torch.long, device=device),
            max(ctx),
        )

    def _build_decode_groups(self) -> list[_DecodeGroup]:
        bs = self.block_size
        device = self.slot_mapping.device
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        groups: list[_DecodeGroup] = []
        if not decode:
            return groups
        all_in_order = len(decode) == self.num_seqs
        for group in _split_by_context(decode, self.context_lens, bs):
            ctx = torch.tensor([self.context_lens[i] for i in group], dtype=torch.long, device=device)
            nblocks = -(-max(self.context_lens[i] for i in group) // bs)
            seqs = torch.tensor(group, dtype=torch.long, device=device)
            width = nblocks * bs
            keep = torch.arange(width, device=device)[None, :] < ctx[:, None]
            # [n, 1, 1, width] broadcasts over kv heads and the grouped query heads. Boolean, not an additive
            # float32 mask: under bfloat16 queries, CUDA's default SDPA backend read a float32 mask wrongly
            # (errors of 1-3 in the outputs on an H100, torch 2.11); a bool mask is cast to the query's dtype.
            mask = keep[:, None, None, :]
            rows = None
            if not (all_in_order and len(group) == self.num_seqs):
                rows = torch.tensor([self._cu[i] for i in group], dtype=torch.long, device=device)
            block_ids = self.block_tables.index_select(0, seqs)[:, :nblocks].reshape(-1).contiguous()
            groups.append(_DecodeGroup(rows, block_ids, mask, width))
        return groups


def _split_by_context(seqs: list[int], context_lens: list[int], block_size: int) -> list[list[int]]:
    """Cut decodes into at most MAX_DECODE_GROUPS groups of similar context (fewer padded keys to attend)."""
    if len(seqs) < 2 * 8:  # small batches: one call is cheaper than the saving
        return [seqs]
    order = sorted(seqs, key=lambda i: context_lens[i])
    blocks = [-(-context_lens[i] // block_size) for i in order]
    best, best_cost = [seqs], len(order) * blocks[-1]  # one group keeps batch order (no row scatter)
    for groups in range(2, MAX_DECODE_GROUPS + 1):
        cuts = [len(order) * g // groups for g in range(groups + 1)]
        cost = sum((cuts[g + 1] - cuts[g]) * blocks[cuts[g + 1] - 1] for g in range(groups))
        if cost < best_cost * (1 - _MIN_GROUP_SAVING):
            best = [order[cuts[g] : cuts[g + 1]] for g in range(groups)]
            best_cost = cost
    return best


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V ``[T, kv_heads, head_dim]`` at their slots of ``kv_cache`` (rounded to its
    dtype: a bfloat16 cache under float32 activations)."""
    if write_kv_in_place(kv_cache, key, value, slot_mapping):
        return
    _, _, _, kvh, hd = kv_cache.shape
    kv_cache[0].view(-1, kvh, hd).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, kvh, hd).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _gather(
    blocks: torch.Tensor, ids: torch.Tensor, name: str, workspace: AttentionWorkspace | None
) -> torch.Tensor:
    """Rows ``ids`` of ``blocks [num_blocks, block_numel]``: one memcpy per block, into reusable scratch."""
    if workspace is None:
        return blocks.index_select(0, ids)
    out = workspace.get(name, ids.numel(), blocks.shape[1], blocks)
    return torch.index_select(blocks, 0, ids, out=out)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of a flat batch over the paged cache.

    ``query`` is ``[T, heads, head_dim]``, ``key``/``value`` ``[T, kv_heads, head_dim]`` (the new tokens, RoPE
    applied). Writes the new K/V into ``kv_cache`` and returns ``[T, heads * head_dim]``, rows in batch order.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size = kv_cache.shape[2]
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    if query.dtype == torch.bfloat16 and query.device.type == "cpu":
        rows = _bf16_rows_attention(query, key, value, kv_cache, meta, scale)
        if rows is not None:
            return rows
        float_rows = (query.float(), key.float(), value.float())
        return paged_attention(*float_rows, kv_cache, meta, scale).to(torch.bfloat16)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    if meta.num_seqs == 1 and meta.prefills and not meta.prefills[0].in_decode_index:
        whole = query.new_empty(num_tokens, num_heads * head_dim)
        if _prefill_kernel(query, kv_cache, meta, meta.prefills, scale, whole):
            return whole
    # Fast path: one sequence, nothing cached (a plain prefill): attend to the new K/V, no cache read.
    if meta.num_seqs == 1 and meta.prefills and meta.prefills[0].block_ids is None:
        key, value = _as_cached(key, kv_cache), _as_cached(value, kv_cache)
        single = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=num_heads // kv_cache.shape[3] > 1,
        )
        return single[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

    out, prefills, complete = _attend_decodes(query, kv_cache, meta, scale)
    if out is not None and complete:
        return out
    if out is None:
        out = query.new_empty(num_tokens, num_heads * head_dim)
    if not _prefill_kernel(query, kv_cache, meta, prefills, scale, out):
        key, value = _as_cached(key, kv_cache), _as_cached(value, kv_cache)
        _attend_prefills(query, key, value, kv_cache, meta.workspace, prefills, scale, out)
    return out


def _bf16_rows_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor | None:
    """A bfloat16 model's rows kept in bfloat16 on CPU (its products give and take bfloat16): the C kernels read
    the bfloat16 query and write a bfloat16 output, the numbers those of float32 rows rounded at the next
    product. None when a kernel does not take them (the caller then widens the rows)."""
    if not meta.bf16_products or meta.static_decode is not None or kv_cache.dtype != torch.bfloat16:
        return None
    num_tokens, num_heads, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads * head_dim)
    write_kv(kv_cache, key, value, meta.slot_mapping)
    prefills = meta.prefills
    dec = meta.decode_index
    if dec is not None:
        if not _decode_kernel(query, kv_cache, dec, scale, out, bf16_values=True):
            return None
        prefills = [seq for seq in meta.prefills if not seq.in_decode_index]
    if prefills and not _prefill_kernel(query, kv_cache, meta, prefills, scale, out):
        return None
    return out


def _decode_kernel(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    dec: _DecodeIndex,
    scale: float,
    out: torch.Tensor,
    *,
    bf16_values: bool,
) -> bool:
    """The C decode kernel over the metadata's decode entries, into their rows of ``out``."""
    return paged_decode_attention(
        query,
        kv_cache,
        dec.block_tables,
        dec.context_lens,
        dec.max_context_len,
        dec.rows,
        scale,
        out,
        bf16_values=bf16_values,
    )


def _as_cached(new: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """The new tokens' K or V as the cache holds them (a bfloat16 cache under float32 activations), so that a
    prompt attends to the same values whether its prefix came from the cache or not. Only the SDPA paths need
    it: the C kernels and the decode groups read the cache itself."""
    return new if kv_cache.dtype == new.dtype else new.to(kv_cache.dtype).to(new.dtype)


def _prefill_kernel(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    prefills: list[_PrefillSeq],
    scale: float,
    out: torch.Tensor,
) -> bool:
    """The prefills' attention by the C kernel, all in one call, reading their K/V in place (CPU float32
    queries); False when it does not apply. Every query row gets the same arithmetic however the prompt was
    split, so prefix caching and chunked prefill stay exact."""
    if not prefills or not _prefill_kernel_on:
        return False
    seqs = [seq.seq for seq in prefills]
    tables = meta.block_tables
    if seqs != list(range(meta.num_seqs)):
        tables = tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=tables.device))
    return paged_prefill_attention(
        query,
        kv_cache,
        tables,
        [seq.ctx_len for seq in prefills],
        [seq.start for seq in prefills],
        [seq.q_len for seq in prefills],
        scale,
        out,
        bf16_products=meta.bf16_products,
    )


_prefill_kernel_on = True


def use_prefill_kernel(on: bool) -> None:
    """Use the C prefill kernel where it applies (the default), or PyTorch's SDPA always (for comparisons)."""
    global _prefill_kernel_on
    _prefill_kernel_on = on


def _attend_decodes(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> tuple[torch.Tensor | None, list[_PrefillSeq], bool]:
    """The decode rows' attention: the C kernel reads their K/V in place (CPU float32); otherwise gather +
    SDPA per decode group. Returns the output so far (None: no row written yet), the prefills still to
    attend, and whether the output is already complete."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, kvh = kv_cache.shape[1], kv_cache.shape[3]
    if meta.static_decode is not None:
        return _attend_static_decode(query, kv_cache, meta.static_decode, scale), [], True
    dec = meta.decode_index
    if dec is not None:
        out = query.new_empty(num_tokens, num_heads * head_dim)
        if _decode_kernel(query, kv_cache, dec, scale, out, bf16_values=meta.bf16_products):
            prefills = [seq for seq in meta.prefills if not seq.in_decode_index]
            return out, prefills, not prefills
    k_blocks = kv_cache[0].view(num_blocks, -1)  # [num_blocks, block_size * kv_heads * head_dim]
    v_blocks = kv_cache[1].view(num_blocks, -1)
    ws = meta.workspace
    group = num_heads // kvh
    result: torch.Tensor | None = None
    for dg in meta.decode_groups:
        n = dg.mask.shape[0]
        k = _gather(k_blocks, dg.block_ids, "k", ws).view(n, dg.width, kvh, head_dim).transpose(1, 2)
        v = _gather(v_blocks, dg.block_ids, "v", ws).view(n, dg.width, kvh, head_dim).transpose(1, 2)
        k, v = k.to(query.dtype), v.to(query.dtype)  # no-op unless a bfloat16 cache under float32
        q = query if dg.rows is None else query.index_select(0, dg.rows)
        # GQA without repeating K/V: the `group` query heads of one kv head act as `group` query positions.
        o = F.scaled_dot_product_attention(
            q.reshape(n, kvh, group, head_dim), k, v, attn_mask=dg.mask, scale=scale
        )
        o = o.reshape(n, num_heads * head_dim)
        if dg.rows is None:
            return o, meta.prefills, True  # the whole batch was this one group
        if result is None:
            result = query.new_empty(num_tokens, num_heads * head_dim)
        result.index_copy_(0, dg.rows, o)
    return result, meta.prefills, False


def _attend_static_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, static: StaticDecode, scale: float
) -> torch.Tensor:
    """Every row a decode, in fixed-shape tensors: gather ``width`` slots per sequence, mask past its
    context on the device, one SDPA call (GQA heads ride in the query axis, as in the decode groups)."""
    n, num_heads, head_dim = query.shape
    num_blocks, kvh = kv_cache.shape[1], kv_cache.shape[3]
    ids = static.block_tables.reshape(-1)
    k = kv_cache[0].view(num_blocks, -1).index_select(0, ids).view(n, static.width, kvh, head_dim)
    v = kv_cache[1].view(num_blocks, -1).index_select(0, ids).view(n, static.width, kvh, head_dim)
    keep = torch.arange(static.width, device=query.device)[None, :] < static.context_lens[:, None]
    o = F.scaled_dot_product_attention(
        query.reshape(n, kvh, num_heads // kvh, head_dim),
        k.transpose(1, 2).to(query.dtype),
        v.transpose(1, 2).to(query.dtype),
        attn_mask=keep[:, None, None, :],
        scale=scale,
    )
    return o.reshape(n, num_heads * head_dim)


def _attend_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    ws: AttentionWorkspace | None,
    prefills: list[_PrefillSeq],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Each prefill's attention into its rows of ``out``: over its new K/V alone when nothing of it is
    cached, else over its context gathered from the cache."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_blocks, block_size, kvh = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    k_blocks = kv_cache[0].view(num_blocks, -1)
    v_blocks = kv_cache[1].view(num_blocks, -1)
    gqa = num_heads // kvh > 1
    for seq in prefills:
        rows = slice(seq.start, seq.start + seq.q_len)
        q = query[rows].transpose(0, 1).unsqueeze(0)
        if seq.block_ids is None:
            k = key[rows].transpose(0, 1).unsqueeze(0)
            v = value[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            n = seq.block_ids.numel() * block_size
            k = (
                _gather(k_blocks, seq.block_ids, "k", ws)
                .view(n, kvh, head_dim)[: seq.ctx_len]
                .to(query.dtype)
            )
            v = (
                _gather(v_blocks, seq.block_ids, "v", ws)
                .view(n, kvh, head_dim)[: seq.ctx_len]
                .to(query.dtype)
            )
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=seq.mask,
                scale=scale,
                enable_gqa=gqa,
            )
        out[rows] = o[0].transpose(0, 1).reshape(seq.q_len, num_heads * head_dim)
