"""Paged attention (Triton kernel under the interpreter, and the torch paths) against a float64
brute force, the graph-safe KV write, and host-sync freedom of every path a CUDA graph captures.

Host-sync checks run on CPU: :class:`NoHostSync` raises on every ATen op that needs the device's
data on the host (``_local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)``; ``nonzero``,
boolean-mask indexing, ``masked_select``, ``bincount``, ``unique``, ``repeat_interleave`` without
``output_size``) and on ``Tensor.tolist`` / ``Tensor.numpy``. The engine test drives the real
``LLM`` in ``graph_mode="static"`` with every graph unit (verify, MTP first pass, draft steps)
run on the captured-style metadata (no host lists, padded sequences) under that guard.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mtpspec.attention.backends.paged_gqa as attention_mod
import mtpspec.ops.paged_attention as pa
from mtpspec.attention.backends.paged_gqa import use_attention_kernel
from mtpspec.layers.attention import (Attention, AttentionMetadata, allocate_kv_caches, build_attention_metadata,
                                      set_forward_context)
from mtpspec.ops.paged_attention import attention_plan, paged_attention, paged_attention_ref, write_kv_cache
from mtpspec.ops.triton_utils import interpreter_available

needs_interpreter = pytest.mark.skipif(not interpreter_available(),
                                       reason="Triton interpreter unavailable (import triton with TRITON_INTERPRET=1)")
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2, torch.float64: 1e-10}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_interpret(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ------------------------------------------------------------------------------------------ helpers
def brute_force(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, qsl: List[int], seq_lens: List[int],
                tables: List[List[int]], scale: float) -> torch.Tensor:
    """float64 reference: query j of sequence i at position seq_len - q_len + j attends positions
    0..that, keys read block by block through the table; rows of no sequence are 0."""
    t, nh, hd = q.shape
    bs, nkv = kc.shape[1], kc.shape[2]
    rep = nh // nkv
    out = torch.zeros(t, nh, hd, dtype=torch.float64)
    for i, s_len in enumerate(seq_lens):
        q_len = qsl[i + 1] - qsl[i]
        if not q_len:
            continue
        pos = torch.arange(s_len)
        blocks = torch.tensor(tables[i], dtype=torch.long)[pos // bs]
        keys = kc[blocks, pos % bs].double()  # [s_len, nkv, hd]
        vals = vc[blocks, pos % bs].double()
        for j in range(q_len):
            p = s_len - q_len + j
            for h in range(nh):
                sc = keys[:p + 1, h // rep] @ q[qsl[i] + j, h].double() * scale
                out[qsl[i] + j, h] = torch.softmax(sc, 0) @ vals[:p + 1, h // rep]
    return out


def make_batch(g: torch.Generator, q_lens: List[int], seq_lens: List[int], nh: int, nkv: int, hd: int, bs: int,
               dtype: torch.dtype, pad_rows: int = 3, garbage: int = 999):
    """Random cache and queries; block tables drawn without replacement from a shuffled pool
    (non-contiguous, out of order), entries past each sequence's blocks set to ``garbage``;
    ``pad_rows`` rows of large values past the real ones."""
    need = [-(-s // bs) for s in seq_lens]
    nb = sum(need) + 3
    kc = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
    vc = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(need) + 2
    tables, c = [], 0
    for n in need:
        tables.append(perm[c:c + n])
        c += n
    bt = torch.tensor([r + [garbage] * (width - len(r)) for r in tables], dtype=torch.int32)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1] + pad_rows, nh, hd, generator=g)
    q[qsl[-1]:] = 1e3
    return (q.to(dtype), kc, vc, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            bt, qsl, tables)


# ------------------------------------------------------------------------------------------ kernel
CASES = [  # nh, nkv, hd, bs, dtype, q_lens, seq_lens
    (4, 4, 64, 16, torch.float32, [1, 0, 1, 1, 0], [70, 0, 130, 5, 0]),          # decode, GQA 1
    (8, 4, 96, 32, torch.float16, [4, 4, 0, 4, 0], [4, 150, 0, 67, 0]),          # verify 1 + 3, GQA 2
    (8, 2, 128, 16, torch.bfloat16, [2, 2, 2, 0], [66, 2, 129, 0]),              # verify 1 + 1, GQA 4
    (8, 2, 64, 32, torch.float32, [6, 1, 6, 0, 0], [6, 90, 200, 0, 0]),          # verify 1 + 5 / decode mixed
    (4, 2, 128, 16, torch.float16, [1, 1, 1], [1, 17, 64]),                      # decode at block edges
    (12, 4, 128, 16, torch.bfloat16, [3, 1, 0], [40, 77, 0]),  # 12 heads: combine blocks of 8 + 4 (masked)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}bs{c[3]}{str(c[4])[6:]}q{max(c[5])}")
def test_kernel_matches_float64_brute_force(kdev, case) -> None:
    nh, nkv, hd, bs, dtype, q_lens, seq_lens = case
    g = torch.Generator().manual_seed(hd * 7 + nh + bs)
    q, kc, vc, qsl_t, sl_t, bt, qsl, tables = make_batch(g, q_lens, seq_lens, nh, nkv, hd, bs, dtype)
    scale = hd ** -0.5
    ref = brute_force(q, kc, vc, qsl, seq_lens, tables, scale)
    n_real = qsl[-1]
    dq, dk, dv, dqsl, dsl, dbt = (x.to(kdev) for x in (q, kc, vc, qsl_t, sl_t, bt))
    for splits in (None, 1, 3):
        out = paged_attention(dq, dk, dv, dqsl, dsl, dbt, scale, max(q_lens), max(seq_lens), num_splits=splits).cpu()
        assert out.shape == q.shape and out.dtype == dtype
        assert torch.isfinite(out).all()
        assert torch.equal(out[n_real:], torch.zeros_like(out[n_real:]))  # padding rows: zeros
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=ATOL[dtype], msg=f"num_splits={splits}")
    # The torch reference (sync-free fallback) agrees with the brute force too.
    out = paged_attention_ref(q, kc, vc, qsl_t, sl_t, bt, scale, max(q_lens), max(seq_lens))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=ATOL[dtype])


def test_kernel_long_queries_several_query_blocks_and_loose_bounds(kdev) -> None:
    """Prefill-like rows (several query blocks per sequence, chunked prefill with context) and
    host bounds larger than the real lengths (as captured graphs pass them)."""
    g = torch.Generator().manual_seed(21)
    nh, nkv, hd, bs = 4, 2, 32, 16
    q_lens, seq_lens = [20, 37, 1, 0], [20, 50, 33, 0]
    q, kc, vc, qsl_t, sl_t, bt, qsl, tables = make_batch(g, q_lens, seq_lens, nh, nkv, hd, bs, torch.float32)
    ref = brute_force(q, kc, vc, qsl, seq_lens, tables, 0.2)
    dev = [x.to(kdev) for x in (q, kc, vc, qsl_t, sl_t, bt)]
    for splits in (None, 2):
        out = paged_attention(*dev, 0.2, 40, 300, num_splits=splits).cpu()
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


def test_kernel_all_padding_and_empty(kdev) -> None:
    """A captured batch whose every sequence is padding (q_len 0, seq_len 0, tables -1): zeros."""
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(2, 16, 2, 64, generator=g).to(kdev), torch.randn(2, 16, 2, 64, generator=g).to(kdev)
    q = torch.randn(8, 4, 64, generator=g).to(kdev)
    qsl, sl = torch.zeros(5, dtype=torch.int32, device=kdev), torch.zeros(4, dtype=torch.int32, device=kdev)
    bt = torch.full((4, 3), -1, dtype=torch.int32, device=kdev)
    for splits in (1, 4):
        out = paged_attention(q, kc, vc, qsl, sl, bt, 0.1, 2, 64, num_splits=splits)
        assert torch.equal(out, torch.zeros_like(q))
    assert paged_attention(q[:0], kc, vc, qsl, sl, bt, 0.1, 2, 64).shape == (0, 4, 64)


def test_attention_plan_depends_on_static_sizes_only() -> None:
    # Decode at 1 sequence x 8192 context, 8 kv heads on 132 SMs: split the keys 32 ways.
    p = attention_plan(1, 1, 32, 8, 8192, sms=132)
    assert p == dict(rep_p=4, block_q=4, block_m=16, q_blocks=1, num_splits=32)
    assert attention_plan(64, 1, 32, 8, 8192, sms=132)["num_splits"] == 1  # 512 programs already
    assert attention_plan(1, 1, 32, 8, 300, sms=132)["num_splits"] == 5  # no split shorter than 64 keys
    v = attention_plan(8, 6, 32, 8, 4096, sms=132)  # verify 1 + 5: 6 rows x 4 heads -> 32 matrix rows
    assert (v["block_m"], v["block_q"], v["q_blocks"]) == (32, 8, 1)
    assert attention_plan(2, 500, 12, 1, 500, sms=132)["block_m"] == 64  # prefill, GQA 12 -> 16
    with pytest.raises(ValueError, match="num_splits"):
        attention_plan(1, 1, 4, 4, 10, sms=1, num_splits=0)


def test_paged_attention_input_errors() -> None:
    q, kc = torch.zeros(3, 4, 8), torch.zeros(2, 4, 2, 8)
    qsl, sl, bt = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1,
                                                                                                             dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be"):
        paged_attention(q[0], kc, kc, qsl, sl, bt, 1.0, 3, 3)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(torch.zeros(3, 3, 8), kc, kc, qsl, sl, bt, 1.0, 3, 3)
    with pytest.raises(ValueError, match="seq_lens must be"):
        paged_attention(q, kc, kc, qsl, sl[:0], bt, 1.0, 3, 3)
    with pytest.raises(TypeError, match="share one of"):
        paged_attention(q, kc.half(), kc.half(), qsl, sl, bt, 1.0, 3, 3)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q, kc[..., :4], kc[..., :4], qsl, sl, bt, 1.0, 3, 3)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(q, kc, kc, qsl, sl, bt, 1.0, -1, 3)


# ------------------------------------------------------------------------------------------ KV write
@pytest.mark.parametrize("kernel", [True, False])
def test_write_kv_cache_skips_minus_one_and_keeps_other_slots(request, monkeypatch, kernel: bool) -> None:
    """Kernel (GPU, or the interpreter) and torch versions: real slots written (cast to the
    cache dtype), -1 rows anywhere skipped, every other slot untouched."""
    dev = "cpu"
    if kernel:
        dev = request.getfixturevalue("kdev")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(4)
    nb, bs, nkv, hd = 5, 4, 2, 8
    for slots, dtype in (([3, -1, 0, 19, -1, 7], torch.float32), ([-1, -1], torch.float16), ([-1, 12], torch.bfloat16)):
        kc, vc = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype), torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
        n = len(slots)
        qkv = torch.randn(n, (4 + 2 * nkv) * hd, generator=g)  # k, v are strided column slices, fp32
        k = qkv[:, 4 * hd:(4 + nkv) * hd].view(n, nkv, hd)
        v = qkv[:, (4 + nkv) * hd:].view(n, nkv, hd)
        exp_k, exp_v = kc.clone().view(-1, nkv, hd), vc.clone().view(-1, nkv, hd)
        for row, s in enumerate(slots):
            if s >= 0:
                exp_k[s], exp_v[s] = k[row].to(dtype), v[row].to(dtype)
        dkc, dvc = kc.to(dev), vc.to(dev)
        write_kv_cache(k.to(dev), v.to(dev), dkc, dvc, torch.tensor(slots, device=dev))
        assert torch.equal(dkc.cpu().view(-1, nkv, hd), exp_k) and torch.equal(dvc.cpu().view(-1, nkv, hd), exp_v)
    with pytest.raises(ValueError, match="do not fit together"):
        write_kv_cache(k[:1], v, kc, vc, torch.tensor(slots))


# ------------------------------------------------------------------------------------------ the layer
def _graph_style_metadata(q_lens: List[int], seq_lens: List[int], tables: List[List[int]], bs: int, n_pad_seqs: int,
                          n_rows: int, width: int) -> AttentionMetadata:
    """Metadata shaped like the engine's captured graphs: ``n_pad_seqs`` zero-length sequences
    (query_start_loc repeats its last value, seq_len 0, table -1), slot -1 padding rows, no host
    lists, loose host bounds."""
    m = build_attention_metadata(q_lens, seq_lens, tables, bs, num_tokens=n_rows)
    b = len(q_lens)
    qsl = torch.cat([m.query_start_loc, m.query_start_loc[-1:].repeat(n_pad_seqs)])
    sl = torch.cat([m.seq_lens, torch.zeros(n_pad_seqs, dtype=torch.int32)])
    bt = torch.full((b + n_pad_seqs, width), -1, dtype=torch.int32)
    bt[:b, :m.block_tables.shape[1]] = m.block_tables
    return AttentionMetadata(query_start_loc=qsl, seq_lens=sl, slot_mapping=m.slot_mapping, block_tables=bt,
                             num_seqs=b + n_pad_seqs, max_query_len=max(q_lens) + 1, max_seq_len=width * bs)


def _run_layer_steps(layer: Attention, seqs, tables, steps, bs: int, graph_style: bool) -> List[torch.Tensor]:
    """Drive ``layer`` through ``steps`` (query lens per sequence); returns per-sequence outputs."""
    nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    done = [0] * len(seqs)
    outs = [torch.zeros(s[0].shape[0], nh * hd, dtype=s[0].dtype) for s in seqs]
    for step in steps:
        active = [i for i, ql in enumerate(step) if ql]
        parts = [[seqs[i][c][done[i]:done[i] + step[i]] for i in active] for c in range(3)]
        pad = 3
        q, k, v = (torch.cat(parts[c] + [torch.full((pad, w * hd), 1e3, dtype=seqs[0][0].dtype)])
                   for c, w in enumerate((nh, nkv, nkv)))
        args = ([step[i] for i in active], [done[i] + step[i] for i in active], [tables[i] for i in active], bs)
        if graph_style:
            meta = _graph_style_metadata(*args, n_pad_seqs=2, n_rows=q.shape[0], width=8)
        else:
            meta = build_attention_metadata(*args, num_tokens=q.shape[0])
        with set_forward_context(meta):
            out = layer(q, k, v)
        assert torch.isfinite(out).all() and torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
        row = 0
        for i in active:
            outs[i][done[i]:done[i] + step[i]] = out[row:row + step[i]]
            row += step[i]
            done[i] += step[i]
    return outs


def _full_causal_ref(q, k, v, nh, nkv, hd, scale):
    t = q.shape[0]
    q, k, v = (z.double().view(t, -1, hd) for z in (q, k, v))
    out = torch.zeros(t, nh, hd, dtype=torch.float64)
    for h in range(nh):
        s = q[:, h] @ k[:, h // (nh // nkv)].T * scale
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[:, h // (nh // nkv)]
    return out.view(t, nh * hd)


@pytest.mark.parametrize("path", ["kernel", "sdpa_interp_write", "sdpa"])
@pytest.mark.parametrize("graph_style", [False, True])
def test_layer_paths_through_prefill_decode_verify(monkeypatch, path: str, graph_style: bool) -> None:
    """Chunked prefill, decode and (1 + k) verification through each path of the layer, with
    host-list metadata and with captured-graph-style metadata; each sequence's rows equal float64
    full causal attention, padding rows never touch the cache."""
    if path != "sdpa" and not interpreter_available():
        pytest.skip("Triton interpreter unavailable")
    if path == "sdpa":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(attention_mod, "KERNEL_MAX_QUERY_LEN", 16 if path == "kernel" else 0)
    g = torch.Generator().manual_seed(5)
    nh, nkv, hd, bs = 4, 2, 16, 4
    scale = hd ** -0.5
    lens = [11, 6, 9]
    seqs = [tuple(torch.randn(n, w * hd, generator=g) for w in (nh, nkv, nkv)) for n in lens]
    tables = [[7, 2, 9], [0, 5], [3, 8, 1]]
    layer = Attention(nh, hd, scale, nkv)
    caches = allocate_kv_caches(torch.nn.Sequential(layer), num_blocks=10, block_size=bs, dtype=torch.float32)
    steps = [[5, 3, 4], [1, 1, 1], [4, 2, 3], [1, 0, 1]]
    outs = _run_layer_steps(layer, seqs, tables, steps, bs, graph_style)
    assert caches[0].abs().max() < 100  # padding values (1e3) never written
    for i in range(len(lens)):
        torch.testing.assert_close(outs[i].double(), _full_causal_ref(*seqs[i], nh, nkv, hd, scale), rtol=1e-5,
                                   atol=1e-5)


def test_mixed_chunk_and_decodes_take_the_kernel(monkeypatch) -> None:
    """Chunked prefill's mixed step: a 40-row chunk beside five 1-row decodes would pad to 6 x 40
    rows in SDPA (4.8x the real 45): the padding rule sends it to the varlen kernel, whose rows
    equal float64 full causal attention."""
    if not interpreter_available():
        pytest.skip("Triton interpreter unavailable")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, bs = 4, 2, 16, 8
    scale = hd ** -0.5
    lens = [40] + [7] * 5
    seqs = [tuple(torch.randn(n, w * hd, generator=g) for w in (nh, nkv, nkv)) for n in lens]
    tables = [[0, 1, 2, 3, 4]] + [[5 + i] for i in range(5)]
    layer = Attention(nh, hd, scale, nkv)
    allocate_kv_caches(torch.nn.Sequential(layer), num_blocks=12, block_size=bs, dtype=torch.float32)
    steps = [[0, 6, 6, 6, 6, 6], [40, 1, 1, 1, 1, 1]]
    mixed = build_attention_metadata([40] + [1] * 5, [40] + [7] * 5, tables, bs)
    assert mixed.max_query_len > attention_mod.KERNEL_MAX_QUERY_LEN and use_attention_kernel(torch.zeros(1, 4, 16),
                                                                                             mixed)
    outs = _run_layer_steps(layer, seqs, tables, steps, bs, graph_style=False)
    for i in range(len(lens)):
        torch.testing.assert_close(outs[i].double(), _full_causal_ref(*seqs[i], nh, nkv, hd, scale), rtol=1e-5,
                                   atol=1e-5)


def test_use_attention_kernel_dispatch(monkeypatch) -> None:
    q = torch.zeros(2, 4, 8)
    decode = build_attention_metadata([1, 1], [5, 9])
    prefill = build_attention_metadata([40, 1], [40, 9])
    no_lists = AttentionMetadata(prefill.query_start_loc, prefill.seq_lens, prefill.slot_mapping, None, 2, 40, 40)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_attention_kernel(q, decode)  # CPU without the interpreter: torch
    if interpreter_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert use_attention_kernel(q, decode) and not use_attention_kernel(q, prefill)
        assert use_attention_kernel(q, no_lists)  # no host lists: never the path that would need them
        mixed = build_attention_metadata([40] + [1] * 30, [40] + [9] * 30)  # padded: 31 x 40 rows for 70
        assert use_attention_kernel(q, mixed)
        assert not use_attention_kernel(q.double(), decode)


# ------------------------------------------------------------------------------------------ host syncs
class HostSyncError(RuntimeError):
    """An op that would copy device data to the host (a CUDA-graph capture breaker) ran."""


# Composite ops (item, is_nonzero, ...) reach a dispatch mode undecomposed under inference_mode,
# so both they and their decompositions are listed.
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
             "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::bincount",
             "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
             "aten::unique_dim_consecutive", "aten::histc"}
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSyncError` on host-syncing ATen ops (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _SYNC_OPS or (name == "aten::where" and len(args) == 1):
            raise HostSyncError(f"{func} reads device data on the host")
        if name in _INDEX_OPS and len(args) > 1:
            for ix in args[1]:
                if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
                    raise HostSyncError(f"{func} with a boolean mask index (data-dependent shape)")
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and \
                (len(args) < 3 or args[-1] is None) and isinstance(args[0], torch.Tensor) and \
                (len(args) == 1 or isinstance(args[1], torch.Tensor)):
            raise HostSyncError(f"{func} without output_size (data-dependent shape)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """:class:`NoHostSync` plus ``Tensor.tolist`` / ``Tensor.numpy`` raising (they bypass dispatch)."""
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy")}

    def boom(name):
        def f(*_a, **_k):
            raise HostSyncError(f"Tensor.{name}() copies device data to the host")
        return f
    try:
        for n in saved:
            setattr(torch.Tensor, n, boom(n))
        with NoHostSync():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_guard_catches_every_kind_of_sync(mode) -> None:
    with mode():
        _check_guard()


def _check_guard() -> None:
    x = torch.arange(6.0)
    idx = torch.tensor([1, 2])
    for fn in (lambda: torch.equal(x, x), lambda: torch.where(x > 1), lambda: x.item() if x.numel() == 1 else x[0].item(), lambda: bool(x.any()), lambda: int(x[1]),
               lambda: x[x > 2], lambda: x.nonzero(), lambda: x.tolist(), lambda: torch.bincount(idx),
               lambda: torch.repeat_interleave(x, idx.repeat(3)), lambda: x.masked_select(x > 1),
               lambda: torch.unique(x), lambda: x.numpy()):
        with pytest.raises(HostSyncError):
            with no_host_sync():
                fn()
    with no_host_sync():  # the sync-free spellings pass
        torch.repeat_interleave(x, idx.repeat(3), output_size=9)
        torch.where(x > 2, x, 0)
        x.index_select(0, idx)


def _layer_and_graph_meta(dtype=torch.float32):
    g = torch.Generator().manual_seed(9)
    nh, nkv, hd, bs = 4, 2, 16, 4
    layer = Attention(nh, hd, hd ** -0.5, nkv)
    allocate_kv_caches(torch.nn.Sequential(layer), 12, bs, dtype)
    layer.kv_cache.normal_(generator=g)
    meta = _graph_style_metadata([4, 4], [9, 4], [[3, 7, 0], [5]], bs, n_pad_seqs=2, n_rows=12, width=6)
    q, k, v = (torch.randn(12, w * hd, generator=g, dtype=dtype) for w in (nh, nkv, nkv))
    return layer, meta, q, k, v


def test_sdpa_path_has_no_host_sync(no_interpret) -> None:
    layer, meta, q, k, v = _layer_and_graph_meta()
    ref_layer = Attention(layer.num_heads, layer.head_dim, layer.scale, layer.num_kv_heads)
    ref_layer.kv_cache = layer.kv_cache.clone()
    with set_forward_context(meta):
        with no_host_sync():
            out = layer(q, k, v)
        meta_lists = AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.slot_mapping, meta.block_tables,
                                       meta.num_seqs, meta.max_query_len, meta.max_seq_len, [4, 4, 0, 0],
                                       [9, 4, 0, 0])
    with set_forward_context(meta_lists):
        torch.testing.assert_close(ref_layer(q, k, v), out)
    torch.testing.assert_close(ref_layer.kv_cache, layer.kv_cache)


@needs_interpreter
def test_kernel_path_launchers_have_no_host_sync(interpret, monkeypatch) -> None:
    """The Python side of the kernel path (checks, planning, allocation, launches) with the
    launches recorded instead of interpreted (the interpreter itself reads tensors on the host)."""
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((self.name, tuple(grid)))

    for name in ("_attn", "_combine", "_write_kv"):
        monkeypatch.setattr(pa, name, Recorder(name))
    monkeypatch.setattr(pa, "MIN_KEYS_PER_SPLIT", 4)  # so this small batch splits its keys
    monkeypatch.setattr(pa, "TARGET_PROGRAMS_PER_SM", 8)
    layer, meta, q, k, v = _layer_and_graph_meta()
    with set_forward_context(meta), no_host_sync():
        out = layer(q, k, v)
    assert out.shape == q.shape
    assert [n for n, _ in launched] == ["_write_kv", "_attn", "_combine"]
    # Grids: one program per row; (padded) sequences x query blocks x kv heads * splits; rows x head
    # blocks (the 4 heads of a row in one combine program).
    assert [grid for _, grid in launched] == [(12,), (4, 1, 2 * 4), (12, 1)]


# ------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_engine_fixtures import make_model
    path = str(tmp_path_factory.mktemp("tiny_graph_sync"))
    _, cfg = make_model(path, seed=5)
    return path, cfg


def test_engine_graph_units_run_sync_free_on_captured_metadata(tiny_model, no_interpret, monkeypatch) -> None:
    """``graph_mode="static"`` with every graph unit run on the metadata the CUDA graphs capture
    (no host lists, padded sequences) under :func:`no_host_sync`: the target verify forward +
    logits, the MTP first pass (with the first draft) and the draft steps (with the greedy draft) never sync, and the
    tokens equal plain eager decoding."""
    from test_engine_fixtures import mixed_prompts, token_prompts

    from mtpspec import LLM, SamplingParams
    from mtpspec.engine.forward import GraphedForward
    from mtpspec.layers.vocab_parallel_embedding import VocabParallelEmbedding

    path, cfg = tiny_model
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = token_prompts(mixed_prompts(5, cfg.vocab_size, seed=2))
    kw = dict(max_model_len=64, block_size=4, num_kv_blocks=128, seed=0, max_num_seqs=4)
    spec = {"num_speculative_tokens": 3}
    with LLM(path, graph_mode="off", speculative_config=spec, **kw) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    units = []

    def guarded_run(self, key, fn, bp, step, rows=None):
        meta = self._meta(bp, host=False, step=step, rows=rows)
        assert not meta.query_lens and not meta.seq_lens_list
        with no_host_sync():
            out = fn(meta)
        units.append(key[0])
        return out

    monkeypatch.setattr(GraphedForward, "_run", guarded_run)
    with LLM(path, graph_mode="static", speculative_config=spec, **kw) as llm:
        runner = llm.executor.runner
        for model in (runner.target, runner.mtp):  # CPU validates token ids with a sync; GPUs do not
            for m in model.modules():
                if isinstance(m, VocabParallelEmbedding):
                    m.validate_ids = False
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.get_metrics()["num_eager_fallbacks"] == 0
    assert outs == ref
    assert {"verify", "firsttop", "step"} <= set(units) and len(units) > 20, units


@needs_interpreter
def test_engine_kernel_path_tokens_equal_torch_path(tiny_model, monkeypatch) -> None:
    """The whole engine (``graph_mode="static"``, speculative k = 3) with attention on the Triton
    kernel (interpreted) emits the tokens of the eager torch path."""
    from test_engine_fixtures import mixed_prompts, token_prompts

    from mtpspec import LLM, SamplingParams

    path, cfg = tiny_model
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = token_prompts(mixed_prompts(5, cfg.vocab_size, seed=2))
    kw = dict(max_model_len=64, block_size=4, num_kv_blocks=128, seed=0, max_num_seqs=4,
              speculative_config={"num_speculative_tokens": 3})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with LLM(path, graph_mode="off", **kw) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    calls = []
    real = attention_mod.paged_attention

    def counting(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(attention_mod, "paged_attention", counting)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with LLM(path, graph_mode="static", **kw) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs == ref
    assert len(calls) > 50 and {4, 16} <= set(calls)  # draft steps (4 padded rows), verify (4 x (1 + 3))


def test_kernels_compile_for_hopper() -> None:
    """Ahead-of-time sm_90 compile (no GPU needed) of the attention, combine (one head and eight
    heads per program), KV-write and rotary kernels and the MoE GEMMs at GLM-4.5-like shapes, with the launch's 16-divisibility of pointers and
    strides: they must compile (the interpreter does not check tile-size rules), load K/V with
    16-byte vectors and not spill more than a few bytes."""
    from mtpspec.ops import triton_utils
    ptr = lambda dt: "*" + dt  # noqa: E731
    plan = attention_plan(1, 4, 32, 8, 8192, sms=132)
    attn_sig = {n: ptr("bf16") for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    attn_sig.update({"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
                     "bt_ptr": "*i32", "qk_scale": "fp32", "num_splits": "i32", "k_scale": "fp32", "v_scale": "fp32"})
    strides = ["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
               "stride_ot", "stride_oh", "stride_bt", "stride_pt", "stride_ph"]
    attn_sig.update({s: "i32" for s in strides})

    def combine_spec(block_s, all_rows=False):  # 64 heads of 128: BLOCK_S 32 -> 1 head per program, 4 -> 8
        ints = ["num_seqs", "num_splits", "num_heads", "stride_ot", "stride_oh", "stride_pt", "stride_ph"]
        return {"module": "mtpspec.ops.paged_attention", "kernel": "_combine",
                "signature": dict({"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                                   "qsl_ptr": "*i32"}, **{n: "i32" for n in ints}),
                "constexprs": dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=block_s,
                                   BLOCK_H=pa.combine_block_h(64, block_s, 128), BF16_BY_BITS=False,
                                   ALL_ROWS=all_rows),
                "aligned": ["out_ptr", "part_acc_ptr", "part_ml_ptr", "stride_ot", "stride_oh"],
                "num_warps": pa.NUM_WARPS}
    specs = [{"module": "mtpspec.ops.paged_attention", "kernel": "_attn", "signature": attn_sig,
              "constexprs": dict(REP=4, REP_P=plan["rep_p"], BLOCK_Q=plan["block_q"], BLOCK_M=plan["block_m"],
                                 BLOCK_N=pa.BLOCK_N, HEAD_DIM=128, BLOCK_D=128, CACHE_BLOCK=16, SPLIT=True,
                                 DOT_FP32=False, PRECISION="tf32", BF16_BY_BITS=False, FP8=False),
              "aligned": ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr", "bt_ptr"] + strides[:11],
              "num_warps": pa.NUM_WARPS},
             combine_spec(32),
             {"module": "mtpspec.ops.paged_attention", "kernel": "_write_kv",
              "signature": {"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "slot_ptr": "*i64",
                            "k_scale": "fp32", "v_scale": "fp32", "stride_kt": "i32", "stride_vt": "i32",
                            "stride_kcb": "i32", "stride_kcs": "i32", "stride_vcb": "i32", "stride_vcs": "i32"},
              "constexprs": dict(ROW=1024, BLOCK_R=1024, CACHE_BLOCK=16, BF16_BY_BITS=False, FP8=False,
                                 FP8_BY_BITS=False),
              "aligned": ["k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "stride_kt", "stride_vt", "stride_kcb", "stride_kcs",
                          "stride_vcb", "stride_vcs"], "num_warps": 4}]
    moe_ints = ["num_pairs", "num_experts", "hidden", "inter_size"]
    specs += [{"module": "mtpspec.ops.moe_gemm", "kernel": "_gate_up",
               "signature": dict({"x_ptr": "*bf16", "w_ptr": "*bf16", "inter_ptr": "*bf16", "sorted_ptr": "*i32",
                                  "block_expert_ptr": "*i32"}, **{n: "i32" for n in moe_ints + [
                                      "stride_xt", "stride_we", "stride_wn", "stride_it"]}),
               "constexprs": dict(TOPK=8, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_FP32=False, PRECISION="tf32",
                                  BF16_BY_BITS=False),
               "aligned": ["x_ptr", "w_ptr", "inter_ptr", "hidden", "stride_xt", "stride_we", "stride_wn", "stride_it"],
               "num_warps": 4},
              {"module": "mtpspec.ops.moe_gemm", "kernel": "_down",
               "signature": dict({"inter_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "sorted_ptr": "*i32",
                                  "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32"}, **{n: "i32" for n in moe_ints + [
                                      "stride_it", "stride_we", "stride_wn", "stride_yt"]}),
               "constexprs": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_FP32=False, PRECISION="tf32"),
               "aligned": ["inter_ptr", "w_ptr", "y_ptr", "inter_size", "stride_it", "stride_we", "stride_wn",
                           "stride_yt"], "num_warps": 4}]
    specs += [
        combine_spec(4), combine_spec(4, all_rows=True),  # the sparse MLA op's combine: every row real
        {"module": "mtpspec.ops.rotary", "kernel": "_rope",  # GLM-4.5's partial rotary on a fused qkv's slices
         "signature": {"q_ptr": "*bf16", "k_ptr": "*bf16", "qo_ptr": "*bf16", "ko_ptr": "*bf16", "pos_ptr": "*i64",
                       "cs_ptr": "*fp32", "num_heads": "i32", "num_kv_heads": "i32", "q_blocks": "i32",
                       "stride_qt": "i32", "stride_kt": "i32", "stride_qot": "i32", "stride_kot": "i32",
                       "stride_cs": "i32"},
         "constexprs": dict(HEAD=128, HALF=32, BLOCK_HALF=32, BLOCK_REST=64, BLOCK_H=16, NEOX=True),
         "aligned": ["q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "cs_ptr", "stride_qt", "stride_kt", "stride_qot",
                     "stride_kot", "stride_cs"], "num_warps": 4}]
    reports = triton_utils.compile_reports(specs)
    for spec, rep in zip(specs, reports):
        assert rep["spill_bytes"] in (0, None) or rep["spill_bytes"] <= 64, (spec["kernel"], rep)
    assert reports[0]["ptx_vec4_loads"] > 0 and reports[2]["ptx_vec4_loads"] > 0, reports
