"""Paged attention in plain PyTorch: the KV cache, the per-step metadata and the attention op.

One forward step runs ONE flat batch of tokens: prefill chunks and single-token decodes of many sequences laid
end to end (``cu_seqlens_q`` marks where each sequence's queries start). Each sequence's keys and values live in
fixed-size blocks of a per-layer cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; its block table
lists the physical blocks in order, so logical position ``p`` is slot ``table[p // block_size] * block_size +
p % block_size``.

The metadata precomputes, once per step, everything the 30-odd layers share (gather indices, masks), so a layer
does only tensor work: write the new K/V by ``slot_mapping``, then

* all sequences with one query token (decodes, and any 1-token chunk) go through ONE batched SDPA call over their
  gathered blocks with a padding mask; grouped-query heads ride in the query-length axis, so K/V are never
  repeated;
* a sequence with several query tokens and nothing cached attends to its own new K/V with ``is_causal``;
* any other sequence (chunked prefill, prefix-cache hit) gathers its context and uses a causal mask offset by the
  cached prefix: query ``i`` sits at position ``ctx_len - q_len + i`` and sees keys ``<=`` that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from app.engine.config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """One zeroed allocation, returned as per-layer views ``[2, num_blocks, block_size, kv_heads, head_dim]``.

    Zeroed, not empty: padded positions are masked with -inf, but ``0 * NaN`` from uninitialised memory would
    still poison ``softmax @ V``.
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    full = torch.zeros(
        config.num_layers,
        2,
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )
    return list(full.unbind(0))


@dataclass
class _PrefillSeq:
    """One multi-token sequence of the batch, with its precomputed gather indices and mask."""

    start: int  # first query row in the flat batch
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor | None  # blocks holding its context; None when nothing is cached (use new K/V)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = may attend


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
    # Precomputed per step (see _prepare): decode group and prefill sequences.
    decode_rows: torch.Tensor | None = field(init=False, default=None, repr=False)
    decode_block_ids: torch.Tensor | None = field(init=False, default=None, repr=False)
    decode_mask: torch.Tensor | None = field(init=False, default=None, repr=False)
    decode_width: int = field(init=False, default=0)
    prefills: list[_PrefillSeq] = field(init=False, default_factory=list, repr=False)

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
        device = self.slot_mapping.device
        cu = [0]
        for q in self.query_lens:
            cu.append(cu[-1] + q)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.long, device=device)
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
        if len(block_tables) != len(query_lens):
            raise ValueError(f"{len(query_lens)} sequences but {len(block_tables)} block tables")
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

    def _prepare(self, cu: list[int]) -> None:
        bs = self.block_size
        device = self.slot_mapping.device
        # Padding entries may be -1: point them at block 0; the mask hides whatever is there.
        tables = self.block_tables.clamp(min=0)
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        if decode:
            ctx = torch.tensor([self.context_lens[i] for i in decode], dtype=torch.long, device=device)
            nblocks = -(-max(self.context_lens[i] for i in decode) // bs)
            rows = torch.tensor(decode, dtype=torch.long, device=device)
            sub = tables if len(decode) == self.num_seqs else tables.index_select(0, rows)
            self.decode_block_ids = sub[:, :nblocks].reshape(-1).contiguous()
            self.decode_width = nblocks * bs
            keep = torch.arange(self.decode_width, device=device)[None, :] < ctx[:, None]
            # Additive mask [B, 1, 1, S]: broadcasts over kv heads and the grouped query heads.
            self.decode_mask = torch.zeros(len(decode), 1, 1, self.decode_width, device=device).masked_fill_(
                ~keep[:, None, None, :], float("-inf")
            )
            if len(decode) != self.num_seqs:
                self.decode_rows = torch.tensor([cu[i] for i in decode], dtype=torch.long, device=device)
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if q == 1:
                continue
            if c == q:
                self.prefills.append(_PrefillSeq(cu[i], q, c, None, None))
                continue
            block_ids = tables[i, : -(-c // bs)].contiguous()
            qpos = torch.arange(c - q, c, device=device)
            mask = torch.arange(c, device=device)[None, :] <= qpos[:, None]
            self.prefills.append(_PrefillSeq(cu[i], q, c, block_ids, mask))


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V ``[T, kv_heads, head_dim]`` at their slots of ``kv_cache``."""
    _, _, _, kvh, hd = kv_cache.shape
    kv_cache[0].view(-1, kvh, hd).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, kvh, hd).index_copy_(0, slot_mapping, value)


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
    applied). Returns ``[T, heads * head_dim]``, rows in batch order.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    group = num_heads // kvh
    write_kv(kv_cache, key, value, meta.slot_mapping)

    # Fast path: one sequence, nothing cached (a plain prefill): no cache read at all.
    if meta.num_seqs == 1 and meta.prefills and meta.prefills[0].block_ids is None:
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=group > 1,
        )
        return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

    k_blocks = kv_cache[0].view(kv_cache.shape[1], -1)  # [num_blocks, block_size * kvh * hd]
    v_blocks = kv_cache[1].view(kv_cache.shape[1], -1)

    decode_out: torch.Tensor | None = None
    if meta.decode_block_ids is not None:
        assert meta.decode_mask is not None
        ids = meta.decode_block_ids
        batch = meta.decode_mask.shape[0]
        width = meta.decode_width
        # Row-wise index_select of whole blocks is a memcpy per block: several times faster than fancy indexing.
        k = k_blocks.index_select(0, ids).view(batch, width, kvh, head_dim).transpose(1, 2)
        v = v_blocks.index_select(0, ids).view(batch, width, kvh, head_dim).transpose(1, 2)
        q = query if meta.decode_rows is None else query.index_select(0, meta.decode_rows)
        # GQA without repeating K/V: the `group` query heads of one kv head act as `group` query positions.
        q = q.reshape(batch, kvh, group, head_dim)
        decode_out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scale)
        decode_out = decode_out.reshape(batch, num_heads * head_dim)
        if meta.decode_rows is None:
            return decode_out

    out = query.new_empty(num_tokens, num_heads * head_dim)
    if decode_out is not None:
        assert meta.decode_rows is not None
        out.index_copy_(0, meta.decode_rows, decode_out)
    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.q_len)
        q = query[rows].transpose(0, 1).unsqueeze(0)
        if seq.block_ids is None:
            k = key[rows].transpose(0, 1).unsqueeze(0)
            v = value[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            n = seq.block_ids.numel() * block_size
            k = k_blocks.index_select(0, seq.block_ids).view(n, kvh, head_dim)[: seq.ctx_len]
            v = v_blocks.index_select(0, seq.block_ids).view(n, kvh, head_dim)[: seq.ctx_len]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=seq.mask,
                scale=scale,
                enable_gqa=group > 1,
            )
        out[rows] = o[0].transpose(0, 1).reshape(seq.q_len, num_heads * head_dim)
    return out
