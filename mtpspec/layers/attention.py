"""The attention layer the models build, and the varlen metadata / forward context that drive it.

One :class:`AttentionMetadata` layout covers prefill, decode and (1 + k)-token verification:
sequence ``i`` contributes ``q_len_i`` new tokens (rows ``query_start_loc[i]:query_start_loc[i+1]``
of the flattened batch) and has ``seq_len_i`` tokens in total after them, so its new tokens sit
at absolute positions ``seq_len_i - q_len_i .. seq_len_i - 1``. Rows past ``query_start_loc[-1]``
(CUDA-graph padding) are never written to the cache and never read by real rows.

The engine sets the metadata around a model forward with :func:`set_forward_context`; every
:class:`Attention` layer reads it through :func:`get_forward_context` and hands it to its
attention backend (:mod:`mtpspec.attention`), which owns the layer's KV-cache layout, dtype, write
and read. Today's backend is paged GQA (:class:`~mtpspec.attention.backends.paged_gqa.PagedGQABackend`:
a cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer, the Triton paged kernel
or one padded SDPA call). :func:`collect_attention_layers` lists a model's cache-owning layers in
forward order; :func:`allocate_kv_caches` is a simple allocator for tests and drivers (the engine
sizes and allocates through :mod:`mtpspec.engine.kv_cache`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Type, Union

import torch
from torch import nn

from mtpspec.attention.backends.abstract import AttentionBackend, AttentionLayerBase
from mtpspec.attention.backends.paged_common import check_cache_metadata, check_metadata_rows
from mtpspec.attention.backends.paged_gqa import PagedGQABackend
from mtpspec.attention.kv_cache_interface import FullAttentionSpec


@dataclass
class AttentionMetadata:
    """Where each new token of a flattened varlen batch belongs.

    Attributes (tensors on the model's device):
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths;
            ``query_start_loc[-1]`` is the number of real tokens.
        seq_lens: ``[num_seqs]`` int32, tokens of each sequence after this step's new tokens.
        slot_mapping: ``[num_tokens]`` int64, KV slot ``block_id * block_size + offset`` of each
            row; ``-1`` marks a padding row (its K/V are not written).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 block ids (entries past a
            sequence's blocks: any value, e.g. -1), or ``None`` when no KV cache is used.

    Host-side values (no device sync needed to read them):
        num_seqs: sequences (rows of ``seq_lens`` / ``block_tables`` used).
        max_query_len: an upper bound of every ``q_len`` (exact, or static under CUDA graphs).
        max_seq_len: an upper bound of every ``seq_len`` (idem).
        query_lens, seq_lens_list: optional python lists of ints, one per sequence (empty when
            unknown, e.g. in captured CUDA-graph metadata); only used for input checks and the
            no-cache equal-length fast path, never required.

    DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5):
        precomputed_topk_pos: ``None`` (every DSA layer with an indexer selects its own
            positions) or ``[num_tokens, K]`` int32 / int64 positions in each row's sequence
            (``-1`` = none, distinct per row, any ``K``) that the DSA layers of this forward
            attend instead: their indexers still write their key caches but skip scoring and
            top-k (the seam for MTP index sharing across draft steps,
            :class:`~mtpspec.layers.indexer.Indexer`).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: Optional[torch.Tensor]
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    query_lens: List[int] = field(default_factory=list)
    seq_lens_list: List[int] = field(default_factory=list)
    precomputed_topk_pos: Optional[torch.Tensor] = None

    @property
    def num_actual_tokens(self) -> int:
        """Real (non-padding) rows of the flattened batch."""
        return int(sum(self.query_lens))


@dataclass
class ForwardContext:
    """What the layers of one model forward read. ``attn_metadata=None``: no varlen layout; the
    whole flattened batch is one sequence starting at position 0, with no KV cache."""

    attn_metadata: Optional[AttentionMetadata] = None


# Per thread: the engines of one process (an AsyncLLM's engine thread, an LLM in the caller's thread) each
# run their forwards in their own thread, so one thread's metadata must never be seen, or restored on
# exit, by another (a process-wide slot left a finished engine's metadata behind for the next caller).
_STATE = threading.local()


@contextlib.contextmanager
def set_forward_context(attn_metadata: Optional[AttentionMetadata]) -> Iterator[ForwardContext]:
    """Make ``attn_metadata`` visible to every :class:`Attention` layer inside the ``with`` block,
    in this thread only (nested blocks restore the outer context on exit)."""
    prev = getattr(_STATE, "ctx", None)
    ctx = _STATE.ctx = ForwardContext(attn_metadata)
    try:
        yield ctx
    finally:
        _STATE.ctx = prev


def get_forward_context() -> ForwardContext:
    """This thread's current :class:`ForwardContext`; an empty one (``attn_metadata=None``) outside
    any :func:`set_forward_context` block."""
    ctx = getattr(_STATE, "ctx", None)
    return ctx if ctx is not None else ForwardContext(None)


def write_cache_rows(layer: AttentionLayerBase, a: torch.Tensor, b: torch.Tensor) -> None:
    """The cache write of a KV-cache-only pass, shared by the attention layers: ``a``, ``b``
    (``[T, ...]``, the two parts the layer's backend ``do_kv_cache_update`` takes: K / V, or an
    MLA latent's ``c_kv`` / ``k_pe``) into ``layer.kv_cache`` at the forward context's slots
    (rows with slot >= 0); nothing without a cache or metadata. No host sync.

    Raises:
        ValueError: metadata longer than the batch, a short ``slot_mapping``, no block tables, or a
            cache of the wrong shape.
    """
    meta = get_forward_context().attn_metadata
    if layer.kv_cache is None or meta is None:
        return
    t = a.shape[0]
    check_metadata_rows(meta, t)
    check_cache_metadata(meta, t)
    layer.impl.do_kv_cache_update(layer, a, b, layer.impl._check_cache(layer.kv_cache), meta.slot_mapping[:t])


def build_attention_metadata(query_lens: Sequence[int], seq_lens: Sequence[int],
                             block_tables: Optional[Union[Sequence[Sequence[int]], torch.Tensor]] = None,
                             block_size: int = 16, device: Union[str, torch.device] = "cpu",
                             num_tokens: Optional[int] = None) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` from per-sequence lengths and block tables.

    Args:
        query_lens: new tokens per sequence (each >= 1).
        seq_lens: total tokens per sequence after the new ones (``seq_len >= query_len``).
        block_tables: per sequence, its KV block ids in order (lists may differ in length; padded
            with -1), or ``None`` for no KV cache (every slot is -1).
        block_size: tokens per KV block.
        device: where the tensors go.
        num_tokens: rows of the flattened batch; rows past ``sum(query_lens)`` are padding
            (slot -1). Default ``sum(query_lens)``.

    Raises:
        ValueError: mismatched lengths, ``seq_len < query_len``, a sequence with more tokens than
            its blocks hold, or ``num_tokens < sum(query_lens)``.
    """
    q = [int(x) for x in query_lens]
    s = [int(x) for x in seq_lens]
    if len(q) != len(s) or not q:
        raise ValueError(f"need one query_len and one seq_len per sequence, got {len(q)} and {len(s)}")
    for i, (a, b) in enumerate(zip(q, s)):
        if a < 1 or b < a:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got query_len={a}, seq_len={b}")
    total = sum(q)
    num_tokens = total if num_tokens is None else int(num_tokens)
    if num_tokens < total:
        raise ValueError(f"num_tokens={num_tokens} is smaller than the {total} real tokens")
    slots = [-1] * num_tokens
    bt_tensor = None
    if block_tables is not None:
        rows = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else [list(r) for r in block_tables]
        if len(rows) != len(q):
            raise ValueError(f"need one block table per sequence: {len(rows)} tables for {len(q)} sequences")
        width = max(1, max(len(r) for r in rows))
        row = 0
        for i, (a, b) in enumerate(zip(q, s)):
            blocks = [x for x in rows[i]]
            if (b + block_size - 1) // block_size > len(blocks):
                raise ValueError(f"sequence {i}: {b} tokens need {(b + block_size - 1) // block_size} blocks "
                                 f"of {block_size}, its table has {len(blocks)}")
            for pos in range(b - a, b):
                slots[row] = int(blocks[pos // block_size]) * block_size + pos % block_size
                row += 1
        bt_tensor = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
    qsl = [0]
    for a in q:
        qsl.append(qsl[-1] + a)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(s, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt_tensor, num_seqs=len(q), max_query_len=max(q), max_seq_len=max(s),
        query_lens=q, seq_lens_list=s)


class Attention(nn.Module, AttentionLayerBase):
    """Causal attention of this rank's heads, with an optional paged KV cache; the cache layout,
    write and read belong to its attention backend.

    Args:
        num_heads: query heads on this rank.
        head_dim: channels per head.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        num_kv_heads: kv heads on this rank (``num_heads`` must be a multiple; default
            ``num_heads``).
        attn_backend: the :class:`~mtpspec.attention.backends.abstract.AttentionBackend` class
            (default :class:`~mtpspec.attention.backends.paged_gqa.PagedGQABackend`).

    Attributes:
        kv_cache: ``None`` or the backend's cache tensor (paged GQA:
            ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, index 0 keys, 1 values),
            assigned by the engine (:meth:`allocate_kv_cache`) or a test.
        impl: the backend's :class:`~mtpspec.attention.backends.abstract.AttentionImpl`.

    Raises:
        ValueError: num_heads not a multiple of num_kv_heads.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: Optional[int] = None,
                 attn_backend: Type[AttentionBackend] = PagedGQABackend) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.attn_backend = attn_backend
        self.impl = attn_backend.get_impl_cls()(num_heads, head_dim, scale, num_kv_heads)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache: Optional[torch.Tensor] = None

    def get_attn_backend(self) -> Type[AttentionBackend]:
        return self.attn_backend

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> FullAttentionSpec:
        """Keys and values of this rank's kv heads: ``2 * block_size * num_kv_heads * head_dim``
        values of ``dtype`` per block."""
        return FullAttentionSpec(block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                                 dtype=dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend with the forward context's metadata (see the backend's ``forward``; paged GQA:
        :meth:`~mtpspec.attention.backends.paged_gqa.PagedGQAImpl.forward`).

        Args:
            q: ``[num_tokens, num_heads * head_dim]`` (rotary already applied).
            k, v: ``[num_tokens, num_kv_heads * head_dim]``.

        Returns:
            ``[num_tokens, num_heads * head_dim]`` in q's dtype; padding rows (past
            ``query_start_loc[-1]``) are zeros. With a cache, rows with slot >= 0 are written
            first; query ``j`` of sequence ``i`` attends to positions ``0 .. seq_len_i - q_len_i + j``.

        Raises:
            ValueError: as the backend's ``forward`` (metadata longer than the batch, short
                ``slot_mapping``, a cache without block tables or of the wrong shape).
        """
        return self.impl.forward(self, q, k, v, self.kv_cache, get_forward_context().attn_metadata)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Only write the cache entries :meth:`forward` would write (a KV-cache-only pass): rows with
        slot >= 0 of the forward context's metadata, through the backend's ``do_kv_cache_update``
        (an fp8 cache quantised with ``k_scale`` / ``v_scale``); nothing without a cache or metadata.
        No host sync.

        Args:
            k, v: ``[num_tokens, num_kv_heads * head_dim]`` (k with rotary applied).

        Raises:
            ValueError: as :meth:`forward` (metadata longer than the batch, short ``slot_mapping``,
                no block tables, a cache of the wrong shape).
        """
        t = k.shape[0]
        write_cache_rows(self, k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"backend={self.attn_backend.get_name()}")


def collect_attention_layers(model: nn.Module) -> List[AttentionLayerBase]:
    """Every cache-owning layer (:class:`~mtpspec.attention.backends.abstract.AttentionLayerBase`,
    e.g. :class:`Attention`) inside ``model``, in registration (= forward) order."""
    return [m for m in model.modules() if isinstance(m, AttentionLayerBase)]


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: Union[str, torch.device] = "cpu") -> List[torch.Tensor]:
    """Give every cache-owning layer of ``model`` its own zeroed cache of ``num_blocks`` blocks in
    its backend's layout (paged GQA: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``);
    returns them in layer order."""
    return [layer.allocate_kv_cache(num_blocks, block_size, dtype, device) for layer in collect_attention_layers(model)]
