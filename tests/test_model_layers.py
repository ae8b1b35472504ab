"""Model building blocks vs independent references: rotary (float64 formula and Hugging Face's GLM-4-MoE
rotation), SiluAndMul, the grouped top-k router (Hugging Face's Glm4MoeTopkRouter and a brute force),
FusedMoE (float64 loop, both checkpoint layouts, every expert path incl. the Triton kernels under the
interpreter, host-sync freedom of the graph-safe paths), and paged attention (float64 causal softmax)."""

import math

import pytest
import torch

from mtpspec.layers.activation import SiluAndMul
from mtpspec.layers.attention import (
    Attention, allocate_kv_caches, build_attention_metadata, collect_attention_layers, get_forward_context,
    set_forward_context)
from mtpspec.layers.fused_moe import GRAPH_SAFE_PATHS, FusedMoE, MoEGate, grouped_topk, moe_path
from mtpspec.ops import moe_gemm
from mtpspec.ops.moe_gemm import moe_align
from mtpspec.ops.paged_attention import write_kv_cache_ref
from mtpspec.ops.triton_utils import interpreter_available
from mtpspec.layers.rotary_embedding import RotaryEmbedding


# ---------------------------------------------------------------------------------------- rotary
def _rope_ref(x, pos, head, rot, base, neox):
    """float64 RoPE by the pair formula (RoFormer eq. 34), independent of the module."""
    x = x.double().view(x.shape[0], -1, head).clone()
    out = x.clone()
    for i in range(rot // 2):
        w = base ** (-2.0 * i / rot)
        ang = pos.double()[:, None] * w
        c, s = torch.cos(ang), torch.sin(ang)
        a_idx, b_idx = (i, i + rot // 2) if neox else (2 * i, 2 * i + 1)
        a, b = x[:, :, a_idx], x[:, :, b_idx]
        out[:, :, a_idx] = a * c - b * s
        out[:, :, b_idx] = b * c + a * s
    return out.view(x.shape[0], -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head,rot", [(32, 16), (16, 16), (24, 8)])
def test_rotary_matches_float64_formula(neox, head, rot):
    g = torch.Generator().manual_seed(head + rot + neox)
    t = 13
    pos = torch.randint(0, 500, (t,), generator=g)
    pos[0] = 0
    q = torch.randn(t, 3 * head, generator=g)
    k = torch.randn(t, 1 * head, generator=g)
    rope = RotaryEmbedding(head, rot, 512, 10000.0, is_neox_style=neox)
    q2, k2 = rope(pos, q, k)
    torch.testing.assert_close(q2.double(), _rope_ref(q, pos, head, rot, 10000.0, neox), rtol=0, atol=2e-5)
    torch.testing.assert_close(k2.double(), _rope_ref(k, pos, head, rot, 10000.0, neox), rtol=0, atol=2e-5)
    assert torch.equal(q2.view(t, 3, head)[..., rot:], q.view(t, 3, head)[..., rot:])  # pass-through part


def test_rotary_matches_hf_glm4_moe_bitwise():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb
    cfg = Glm4MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=32, partial_rotary_factor=0.5,
                        max_position_embeddings=300)
    hf = Glm4MoeRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(3)
    t = 9
    pos = torch.randint(0, 300, (t,), generator=g)
    q = torch.randn(t, 2 * 32, generator=g)
    k = torch.randn(t, 1 * 32, generator=g)
    cos, sin = hf(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.view(1, t, 2, 32).transpose(1, 2), k.view(1, t, 1, 32).transpose(1, 2),
                                      cos, sin)
    ours = RotaryEmbedding(32, 16, 300, cfg.rope_parameters["rope_theta"], True)
    q2, k2 = ours(pos, q, k)
    assert torch.equal(q2, q_hf.transpose(1, 2).reshape(t, 64))
    assert torch.equal(k2, k_hf.transpose(1, 2).reshape(t, 32))


def test_rotary_rejects_bad_dims():
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(16, 7, 10, 10000.0)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(16, 32, 10, 10000.0)


def test_silu_and_mul():
    x = torch.randn(5, 12, dtype=torch.float64)
    ref = x[:, :6] / (1 + torch.exp(-x[:, :6])) * x[:, 6:]
    torch.testing.assert_close(SiluAndMul()(x), ref)
    with pytest.raises(ValueError, match="even"):
        SiluAndMul()(torch.randn(2, 3))


# ---------------------------------------------------------------------------------------- router
def _brute_force_topk(logits, bias, top_k, n_group, topk_group, renorm, scale):
    """Per token, plain Python: pick groups by top-2 sums, then experts; float64."""
    s = torch.sigmoid(logits.double())
    c = s + bias.double()
    e = s.shape[1]
    per = e // n_group
    ws, ids = [], []
    for t in range(s.shape[0]):
        gs = [sorted(c[t, g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -sum(gs[g]))[:topk_group]
        cand = [x for g in groups for x in range(g * per, (g + 1) * per)]
        chosen = sorted(cand, key=lambda x: -c[t, x].item())[:top_k]
        w = torch.tensor([s[t, x].item() for x in chosen], dtype=torch.float64)
        if renorm:
            w = w / w.sum()
        ws.append(w * scale)
        ids.append(chosen)
    return ws, ids


@pytest.mark.parametrize("e,k,ng,tg,renorm,scale", [(8, 3, 2, 1, True, 1.5), (16, 4, 4, 2, False, 2.5),
                                                    (6, 2, 1, 1, True, 1.0)])
def test_grouped_topk_vs_brute_force_and_hf(e, k, ng, tg, renorm, scale):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    g = torch.Generator().manual_seed(e * k)
    h, t = 16, 40
    x = torch.randn(t, h, generator=g)
    gate = MoEGate(h, e, k, ng, tg, renorm, scale)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(e, h, generator=g))
        gate.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=g))
    w, ids = gate(x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    bw, bids = _brute_force_topk(x @ gate.weight.T, gate.e_score_correction_bias, k, ng, tg, renorm, scale)
    for row in range(t):
        order = torch.argsort(ids[row])
        assert ids[row][order].tolist() == sorted(bids[row])
        ref = dict(zip(bids[row], bw[row].tolist()))
        torch.testing.assert_close(w[row][order].double(), torch.tensor([ref[i] for i in ids[row][order].tolist()],
                                                                         dtype=torch.float64), rtol=1e-6, atol=1e-7)
    cfg = Glm4MoeConfig(hidden_size=h, n_routed_experts=e, num_experts_per_tok=k, n_group=ng, topk_group=tg,
                        norm_topk_prob=renorm, routed_scaling_factor=scale)
    hf = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(gate.weight)
        hf.e_score_correction_bias.copy_(gate.e_score_correction_bias)
    _, hw, hids = hf(x)
    for row in range(t):
        a, b = torch.argsort(ids[row]), torch.argsort(hids[row])
        assert torch.equal(ids[row][a], hids[row][b])
        assert torch.equal(w[row][a], hw[row][b].float())


# ---------------------------------------------------------------------------------------- experts
def test_fused_moe_vs_float64_loop_and_layouts():
    g = torch.Generator().manual_seed(11)
    e, h, i, t, k = 6, 16, 12, 9, 2
    gate_w = torch.randn(e, i, h, generator=g) / 4
    up_w = torch.randn(e, i, h, generator=g) / 4
    down_w = torch.randn(e, h, i, generator=g) / 3
    x = torch.randn(t, h, generator=g)
    tw = torch.rand(t, k, generator=g)
    tid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    per = FusedMoE(e, h, i, reduce_results=True, params_dtype=torch.float32)
    for x_id in range(e):
        per.weight_loader(per.w13_weight, gate_w[x_id], "w1", x_id)
        per.weight_loader(per.w13_weight, up_w[x_id], "w3", x_id)
        per.weight_loader(per.w2_weight, down_w[x_id], "w2", x_id)
    fused = FusedMoE(e, h, i, reduce_results=True, params_dtype=torch.float32)
    fused.weight_loader(fused.w13_weight, torch.cat([gate_w, up_w], dim=1), "w13")
    fused.weight_loader(fused.w2_weight, down_w, "w2")
    assert torch.equal(per.w13_weight, fused.w13_weight) and torch.equal(per.w2_weight, fused.w2_weight)
    ref = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in range(k):
            x_id = int(tid[r, j])
            a = gate_w[x_id].double() @ x[r].double()
            b = up_w[x_id].double() @ x[r].double()
            ref[r] += tw[r, j].double() * (down_w[x_id].double() @ (a * torch.sigmoid(a) * b))
    for budget in (0, 2 ** 30):  # grouped-by-expert path, then the dense all-experts path
        per.dense_budget_bytes = budget
        torch.testing.assert_close(per(x, tw, tid).double(), ref, rtol=1e-5, atol=1e-5)
        assert per(x[:0], tw[:0], tid[:0]).shape == (0, h)
    # Dense path: an unrouted expert overflowing to inf must not leak (inf * 0 = NaN).
    with torch.no_grad():
        per.w2_weight[5] = float("inf")
    keep = (tid != 5).all(-1)
    assert 0 < int(keep.sum()) < len(keep)
    assert torch.isfinite(per(x[keep], tw[keep], tid[keep])).all()
    with pytest.raises(ValueError, match=r"expected full shape \[12, 16\], got \[16, 12\]"):
        per.weight_loader(per.w13_weight, down_w[0], "w1", 0)
    with pytest.raises(ValueError, match="expert_id 6 out of range"):
        per.weight_loader(per.w13_weight, gate_w[0], "w1", 6)


def _moe_float64(x, w13, w2, tw, tid):
    """float64 loop over (token, chosen expert): silu(gate x) * (up x), down, weighted sum."""
    d = w13.shape[1] // 2
    ref = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for r in range(x.shape[0]):
        for j in range(tid.shape[1]):
            e = int(tid[r, j])
            gu = w13[e].double() @ x[r].double()
            ref[r] += tw[r, j].double() * (w2[e].double() @ (torch.nn.functional.silu(gu[:d]) * gu[d:]))
    return ref


def _random_moe(g, e, h, i, dtype):
    moe = FusedMoE(e, h, i, reduce_results=True, params_dtype=dtype)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5)
        moe.w2_weight.copy_(torch.randn(e, h, i, generator=g) / i ** 0.5)
    return moe


MOE_ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("path", ["kernel", "kernel_chunked", "gather", "dense", "grouped"])
def test_fused_moe_every_path_vs_float64(monkeypatch, path):
    """Each expert path on decode-, verify- and graph-padded-sized batches against the float64
    loop; the kernel path (Triton, interpreted) also in fp16 and bf16."""
    dev = "cpu"
    if path.startswith("kernel"):  # a CUDA GPU when there is one, else the interpreter
        if torch.cuda.is_available():
            dev = "cuda"
        elif not interpreter_available():
            pytest.skip("no GPU and no Triton interpreter")
        else:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        dtypes = [torch.float32]
    g = torch.Generator().manual_seed(12)
    e, h, i, k = 16, 48, 40, 2
    for dtype in dtypes:
        moe = _random_moe(g, e, h, i, dtype)
        budgets = dict(kernel="kernel_budget_bytes", kernel_chunked="kernel_budget_bytes", gather="gather_budget_bytes",
                       dense="dense_budget_bytes", grouped=None)
        moe.dense_budget_bytes = 2 ** 30 if path == "dense" else 0
        moe.gather_budget_bytes = 2 ** 30 if path == "gather" else 0
        if path == "kernel_chunked":
            moe.kernel_budget_bytes = 3 * k * (h * 4 + i * moe.w13_weight.element_size())  # 3 tokens per launch
        assert budgets[path] is None or hasattr(moe, budgets[path])
        for t in ((1, 2) if path == "gather" else (1, 5, 11)):  # gather: 3 * t * k <= E
            x = torch.randn(t, h, generator=g).to(dtype)
            x[-1] = 0  # a graph padding row: zero hidden state, whatever it routes to
            tw = torch.rand(t, k, generator=g)
            tid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            moe.to(dev)
            assert moe.select_path(t, k, x.to(dev)) == path.split("_")[0]
            out = moe(x.to(dev), tw.to(dev), tid.to(dev)).cpu()
            moe.to("cpu")
            assert out.dtype == dtype and out.shape == (t, h)
            torch.testing.assert_close(out.double(), _moe_float64(x, moe.w13_weight, moe.w2_weight, tw, tid),
                                       rtol=0, atol=MOE_ATOL[dtype])
            assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        assert moe(x[:0], tw[:0], tid[:0]).shape == (0, h)


def test_moe_align_groups_pairs_by_expert_with_static_padding():
    g = torch.Generator().manual_seed(13)
    for t, k, e, bm in ((1, 2, 16, 16), (9, 3, 4, 16), (40, 2, 5, 64), (3, 4, 64, 16)):
        tid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        n = t * k
        pairs, block_expert = moe_align(tid, e, bm)
        assert pairs.shape[0] == -(-(n + min(n, e) * (bm - 1)) // bm) * bm == block_expert.shape[0] * bm
        flat = tid.reshape(-1).tolist()
        seen = []
        for b, ex in enumerate(block_expert.tolist()):
            blk = pairs[b * bm:(b + 1) * bm].tolist()
            real = [p for p in blk if p < n]
            if ex == e:  # past the last run: only padding
                assert not real
                continue
            assert all(flat[p] == ex for p in real) and blk == real + [n] * (bm - len(real))
            seen += real
        assert sorted(seen) == list(range(n))
        assert block_expert.tolist() == sorted(block_expert.tolist())  # runs in expert order


@pytest.mark.parametrize("t,k,e,bm", [(1, 8, 128, 16), (1, 2, 16, 16), (9, 3, 4, 16), (16, 8, 256, 16),
                                      (40, 2, 5, 64), (64, 8, 160, 16), (128, 8, 256, 64), (100, 6, 64, 64),
                                      (64, 9, 129, 16), (455, 9, 129, 64)])
def test_moe_align_kernel_equals_the_torch_grouping(kdev, t, k, e, bm):
    """The one-program align kernel (decode and verify sizes) == the torch-ops grouping, entry for
    entry: same padded layout, pairs of one expert in their original order, int32 and int64 ids;
    experts with no pair and ids crowded into few experts (several blocks per expert) included."""
    g = torch.Generator().manual_seed(t * 1000 + e)
    used = e if t < 40 else max(k, e // 8)  # from 40 tokens: crowded into e / 8 experts, several blocks each
    tid = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(t)])  # distinct per token
    assert 0 < tid.numel() <= moe_gemm.ALIGN_KERNEL_MAX_PAIRS
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        want = moe_align(tid, e, bm)  # CPU tensors without the interpreter: the torch ops
    for dtype in (torch.int64, torch.int32):
        got = moe_align(tid.to(dtype).to(kdev), e, bm)
        assert moe_gemm.use_triton(tid.to(kdev))
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (got, want)


def test_moe_path_depends_on_static_sizes_and_captured_sizes_are_graph_safe():
    # GLM-4.5 (E = 160, H = 5120, I = 1536, top 8) at tp 8, bf16: every captured verify size of
    # max_num_seqs = 512, k = 3 takes a sync-free path, on GPU (kernel) and on the torch paths.
    for tokens in (1, 4, 8, 64, 256, 2048):
        assert moe_path(tokens, 8, 160, 5120, 192, 2, True, 256 << 20, 256 << 20, 128 << 20) == "kernel"
    assert moe_path(1, 8, 160, 5120, 192, 2, False, 256 << 20, 256 << 20, 128 << 20) == "gather"
    assert moe_path(6, 8, 160, 5120, 192, 2, False, 256 << 20, 256 << 20, 128 << 20) == "dense"
    assert moe_path(400, 8, 160, 5120, 192, 2, False, 256 << 20, 256 << 20, 128 << 20) == "grouped"
    assert moe_path(0, 8, 160, 5120, 192, 2, True, 1, 1, 1) == "grouped"  # empty: zeros, no work
    assert "grouped" not in GRAPH_SAFE_PATHS and set(GRAPH_SAFE_PATHS) == {"kernel", "gather", "dense"}


@pytest.mark.parametrize("path", ["kernel", "gather", "dense"])
def test_fused_moe_graph_safe_paths_have_no_host_sync(monkeypatch, path):
    """Router + experts under the host-sync guard; the kernel path with its launches recorded
    (the interpreter itself reads tensors on the host)."""
    from test_paged_attention import HostSyncError, no_host_sync
    g = torch.Generator().manual_seed(14)
    e, h, i, k, t = 16, 32, 24, 2, 2
    moe = _random_moe(g, e, h, i, torch.float32)
    gate = MoEGate(h, e, k, num_expert_group=4, topk_group=2)
    with torch.no_grad():
        gate.weight.normal_(generator=g)
    launched = []
    if path == "kernel":
        if not interpreter_available():
            pytest.skip("Triton interpreter unavailable")
        monkeypatch.setenv("TRITON_INTERPRET", "1")

        class Recorder:
            def __init__(self, name):
                self.name = name

            def __getitem__(self, grid):
                return lambda *a, **kw: launched.append(self.name)
        monkeypatch.setattr(moe_gemm, "_gate_up", Recorder("gate_up"))
        monkeypatch.setattr(moe_gemm, "_down", Recorder("down"))
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        moe.dense_budget_bytes = 2 ** 30 if path == "dense" else 0
        moe.gather_budget_bytes = 2 ** 30 if path == "gather" else 0
    x = torch.randn(t, h, generator=g)
    assert moe.select_path(t, k, x) == path
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), no_host_sync():
            moe(x, *gate(x))
    assert launched == (["gate_up", "down"] * 2 if path == "kernel" else [])
    moe.dense_budget_bytes = moe.gather_budget_bytes = 0
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(HostSyncError):  # the guard does see the grouped path's sync
        with torch.no_grad(), no_host_sync():
            moe(x, *gate(x))


@pytest.mark.parametrize("e,k,ng,tg,renorm,scale,bias", [
    (256, 8, 8, 4, True, 2.5, True),  # DeepSeek-V3
    (160, 8, 1, 1, True, 2.5, True),  # GLM-4.5 (no groups, E not a power of two)
    (8, 3, 2, 1, True, 1.5, True), (16, 4, 4, 2, False, 2.5, False), (6, 2, 1, 1, True, 1.0, True),
    (12, 3, 12, 4, True, 1.0, True),  # one expert per group: a group's score is its only c
])
def test_router_kernel_vs_brute_force_and_torch(kdev, e, k, ng, tg, renorm, scale, bias):
    """The one-launch router (Triton; the interpreter on CPU) == the float64 brute force: same
    experts, weights to fp32 rounding, ids best first; and the same experts as the torch ops."""
    from mtpspec.layers.fused_moe import grouped_topk
    from mtpspec.ops.moe_router import grouped_topk_triton
    g = torch.Generator().manual_seed(e * 100 + k)
    t = 24
    logits = torch.randn(t, e, generator=g) * 2
    b = 0.3 * torch.randn(e, generator=g) if bias else None
    w, ids = grouped_topk(logits.to(kdev), None if b is None else b.to(kdev), k, ng, tg, renorm, scale)
    w, ids = w.cpu(), ids.cpu()
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (t, k)
    bw, bids = _brute_force_topk(logits, torch.zeros(e) if b is None else b, k, ng, tg, renorm, scale)
    c = torch.sigmoid(logits.double()) + (0 if b is None else b.double())
    for row in range(t):
        assert ids[row].tolist() == bids[row], (row, ids[row], bids[row])  # best first
        assert (c[row, ids[row]].diff() <= 0).all()
        torch.testing.assert_close(w[row].double(), bw[row], rtol=1e-6, atol=1e-7)
    with pytest.MonkeyPatch.context() as mp:  # the torch ops on CPU pick the same set
        mp.delenv("TRITON_INTERPRET", raising=False)
        tw, tids = grouped_topk(logits, b, k, ng, tg, renorm, scale)
    assert torch.equal(tids.sort(1)[0], ids.sort(1)[0])
    torch.testing.assert_close(tw.gather(1, tids.argsort(1)), w.gather(1, ids.argsort(1)), rtol=1e-6, atol=1e-7)
    for rows in (1, 4):  # the GPU's launch shape (a row per program), and a partial last program
        rw, rids = grouped_topk_triton(logits[:7].to(kdev), None if b is None else b.to(kdev), k, ng, tg, renorm,
                                       scale, rows=rows)
        # the same experts; the weights to fp32 rounding (on the H200 the renormalising sum of a
        # 4-row program is compiled in another order than a 1-row one's: a few ulp apart)
        assert torch.equal(rids.cpu(), ids[:7]), rows
        torch.testing.assert_close(rw.cpu(), w[:7], rtol=1e-6, atol=0)
    empty = grouped_topk_triton(logits[:0].to(kdev), None, k, ng, tg, renorm, scale)
    assert empty[0].shape == (0, k) and empty[1].shape == (0, k)


@pytest.mark.parametrize("t,e,h", [(1, 128, 4096), (3, 160, 200), (16, 8, 64), (17, 8, 64)])
def test_router_logits_kernel_vs_float64(kdev, t, e, h):
    """The router's fp32 logits (the Triton GEMV up to 16 tokens, cuBLAS / torch above) equal a
    float64 product to fp32 rounding, for bf16 and fp32 inputs, strided rows included."""
    from mtpspec.ops.moe_router import router_logits
    g = torch.Generator().manual_seed(t * e)
    w = torch.randn(e, h, generator=g) / h ** 0.5
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(t, 2 * h, generator=g).to(dtype)[:, :h]  # row stride 2 h
        ref = x.double() @ w.double().t()
        out = router_logits(x.to(kdev), w.to(kdev)).cpu()
        assert out.dtype == torch.float32 and out.shape == (t, e)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,e,k,ng,tg,shared,bias", [(1, 128, 8, 1, 1, 1, False), (5, 256, 8, 8, 4, 1, True),
                                                     (16, 160, 8, 1, 1, 0, True), (3, 12, 3, 12, 4, 2, False)])
def test_logits_and_routing_in_one_launch(kdev, t, e, k, ng, tg, shared, bias):
    """fused_route (the logits GEMV whose last program to finish routes every token) == router_logits
    then grouped_topk_triton: the same experts in the same order, the weights to fp32 rounding (the
    fused kernel routes all rows in one tile: on a GPU the renormalising sum may compile in another
    order than the 1-row router's); MoEGate takes it at decode sizes; its counter ends at zero."""
    from mtpspec.ops.moe_router import fused_route, grouped_topk_triton, router_logits
    from mtpspec.ops.triton_utils import arrival_counters
    g = torch.Generator().manual_seed(t * e + k)
    h = 96
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(kdev)
    w = (torch.randn(e, h, generator=g) / h ** 0.5).to(kdev)
    b = (0.3 * torch.randn(e, generator=g)).to(kdev) if bias else None
    args = (k, ng, tg, True, 2.5)
    fw, fids = fused_route(x, w, b, *args, num_shared_experts=shared)
    rw, rids = grouped_topk_triton(router_logits(x, w), b, *args, num_shared_experts=shared)
    assert fids.shape == (t, k + shared) and torch.equal(fids, rids)
    torch.testing.assert_close(fw, rw, rtol=1e-6, atol=0)
    assert not arrival_counters(x.device, 1).any()
    gate = MoEGate(h, e, k, num_expert_group=ng, topk_group=tg, routed_scaling_factor=2.5,
                   use_correction_bias=bias).to(kdev)
    with torch.no_grad():
        gate.weight.copy_(w)
        if bias:
            gate.e_score_correction_bias.copy_(b)
    gate.num_shared_fused = shared
    with torch.no_grad():
        gw, gids = gate(x)
    assert torch.equal(gids, fids) and torch.equal(gw, fw)
    assert fused_route(x[:0], w, b, *args) is None and fused_route(x.repeat(17, 1)[:17], w, b, *args) is None


@pytest.mark.parametrize("t,k,h", [(1, 9, 4096), (5, 3, 200), (0, 2, 64)])
def test_sum_pairs_kernel(kdev, t, k, h):
    """``sum_pairs`` sums each token's ``k`` fp32 rows in order and casts (bf16 and fp32 out)."""
    from mtpspec.ops.moe_gemm import sum_pairs
    y = torch.randn(t * k, h, generator=torch.Generator().manual_seed(h))
    acc = torch.zeros(t, h)
    for j in range(k):
        acc = acc + y.view(t, k, h)[:, j]
    for dtype in (torch.bfloat16, torch.float32):
        out = sum_pairs(y.to(kdev), t, k, dtype).cpu()
        assert out.dtype == dtype and out.shape == (t, h)
        assert torch.equal(out, acc.to(dtype))


def test_router_kernel_ties_and_nan(kdev):
    """Ties go to the lowest expert id (experts and groups); a NaN score ranks first, as in
    torch.topk, and ids stay in range."""
    from mtpspec.ops.moe_router import grouped_topk_triton
    logits = torch.zeros(3, 8)
    logits[1, 5] = float("nan")
    logits[2, :4] = 1.0  # groups 0 and 1 tie on score; group 0 (lowest) wins with topk_group 1
    logits[2, 4:] = 1.0
    w, ids = grouped_topk_triton(logits.to(kdev), None, 3, 2, 1, False, 1.0)
    ids = ids.cpu()
    assert ids[0].tolist() == [0, 1, 2]  # all equal: lowest ids, in order
    assert ids[1].tolist() == [5, 4, 6]  # NaN's group (1) is the one kept; then its lowest ids
    assert ids[2].tolist() == [0, 1, 2]
    assert w.cpu()[1, 0].isnan() and torch.equal(w.cpu()[0], torch.full((3,), 0.5))


def test_grouped_topk_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="inconsistent"):
        grouped_topk(torch.zeros(2, 6), None, 2, num_expert_group=4)


# ---------------------------------------------------------------------------------------- attention
def _attn_ref(q, k, v, nh, nkv, hd, scale):
    """float64 causal softmax attention of one sequence (all its tokens), GQA by head index."""
    t = q.shape[0]
    q, k, v = (z.double().view(t, -1, hd) for z in (q, k, v))
    out = torch.zeros(t, nh, hd, dtype=torch.float64)
    for hh in range(nh):
        kv = hh // (nh // nkv)
        s = q[:, hh] @ k[:, kv].T * scale
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        out[:, hh] = torch.softmax(s, -1) @ v[:, kv]
    return out.view(t, nh * hd)


def test_attention_paged_cache_prefill_decode_verify_and_padding():
    """Three sequences driven through chunked prefill, decode and (1 + k)-token verification steps
    with a paged cache (scattered, shared-pool blocks); every real row equals float64 full-sequence
    causal attention, padding rows never touch the cache or the real rows."""
    g = torch.Generator().manual_seed(5)
    nh, nkv, hd, bs = 4, 2, 8, 4
    scale = hd ** -0.5
    lens = [11, 6, 9]
    seqs = [(torch.randn(n, nh * hd, generator=g), torch.randn(n, nkv * hd, generator=g),
             torch.randn(n, nkv * hd, generator=g)) for n in lens]
    tables = [[7, 2, 9], [0, 5], [3, 8, 1]]  # 10 blocks in the pool, out of order
    layer = Attention(nh, hd, scale, nkv)
    container = torch.nn.Sequential(layer)
    caches = allocate_kv_caches(container, num_blocks=10, block_size=bs, dtype=torch.float32)
    assert collect_attention_layers(container) == [layer] and caches[0].shape == (2, 10, bs, nkv, hd)
    # Steps: (query_len per sequence); each step's tokens follow the previous ones.
    steps = [[5, 3, 4], [1, 1, 1], [4, 2, 3], [1, 0, 1]]
    done = [0, 0, 0]
    outs = [torch.zeros(n, nh * hd) for n in lens]
    for step in steps:
        active = [i for i, ql in enumerate(step) if ql]
        qs, ks, vs = [], [], []
        for i in active:
            a, b = done[i], done[i] + step[i]
            qs.append(seqs[i][0][a:b]); ks.append(seqs[i][1][a:b]); vs.append(seqs[i][2][a:b])
        pad = 3  # CUDA-graph-style padding rows: garbage values, slot -1
        q = torch.cat(qs + [torch.full((pad, nh * hd), 1e4)])
        k = torch.cat(ks + [torch.full((pad, nkv * hd), 1e4)])
        v = torch.cat(vs + [torch.full((pad, nkv * hd), 1e4)])
        meta = build_attention_metadata([step[i] for i in active], [done[i] + step[i] for i in active],
                                        [tables[i] for i in active], bs, num_tokens=q.shape[0])
        assert meta.slot_mapping[-pad:].tolist() == [-1] * pad
        bt = meta.block_tables
        meta.block_tables = torch.where(bt < 0, torch.full_like(bt, 999), bt)  # "any value" past the blocks
        with set_forward_context(meta):
            assert get_forward_context().attn_metadata is meta
            out = layer(q, k, v)
        assert get_forward_context().attn_metadata is None
        assert torch.isfinite(out).all() and torch.equal(out[-pad:], torch.zeros(pad, nh * hd))
        row = 0
        for i in active:
            outs[i][done[i]:done[i] + step[i]] = out[row:row + step[i]]
            row += step[i]
            done[i] += step[i]
    assert caches[0].abs().max() < 1e3  # padding values never written
    for i, n in enumerate(lens):
        ref = _attn_ref(*seqs[i], nh, nkv, hd, scale)
        torch.testing.assert_close(outs[i].double(), ref, rtol=1e-5, atol=1e-5)


def test_attention_without_cache_is_causal_per_sequence():
    g = torch.Generator().manual_seed(6)
    nh, nkv, hd = 2, 1, 8
    layer = Attention(nh, hd, 0.3, nkv)
    lens = [4, 1, 6]
    q, k, v = (torch.randn(sum(lens) + 2, n * hd, generator=g) for n in (nh, nkv, nkv))
    meta = build_attention_metadata(lens, [l + 5 for l in lens], None, num_tokens=sum(lens) + 2)
    with set_forward_context(meta):
        out = layer(q, k, v)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        torch.testing.assert_close(out[sl].double(), _attn_ref(q[sl], k[sl], v[sl], nh, nkv, hd, 0.3),
                                   rtol=1e-5, atol=1e-5)
        start += n
    assert torch.equal(out[start:], torch.zeros(2, nh * hd))
    # No context at all: one causal sequence over every row.
    torch.testing.assert_close(layer(q, k, v).double(), _attn_ref(q, k, v, nh, nkv, hd, 0.3), rtol=1e-5, atol=1e-5)


def test_build_attention_metadata_errors():
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        build_attention_metadata([3], [2])
    with pytest.raises(ValueError, match="need 3 blocks"):
        build_attention_metadata([9], [9], [[0, 1]], block_size=4)
    with pytest.raises(ValueError, match="smaller than the 5 real tokens"):
        build_attention_metadata([2, 3], [2, 3], num_tokens=4)
    m = build_attention_metadata([2, 1], [5, 1], [[4, 6], [1]], block_size=4)
    assert m.slot_mapping.tolist() == [4 * 4 + 3, 6 * 4 + 0, 1 * 4 + 0]  # positions 3, 4 and 0
    assert m.query_start_loc.tolist() == [0, 2, 3] and m.max_seq_len == 5 and m.num_actual_tokens == 3
    assert math.isclose(Attention(2, 4, 0.5).scale, 0.5)


def test_kv_write_skips_minus_one_slots_anywhere():
    g = torch.Generator().manual_seed(8)
    for slots in ([3, -1, 0, 5, -1], [-1, -1], [-1, 2, 2 + 0 * 1]):
        k_cache, v_cache = torch.randn(6, 2, 4, generator=g), torch.randn(6, 2, 4, generator=g)
        k, v = torch.randn(len(slots), 2, 4, generator=g), torch.randn(len(slots), 2, 4, generator=g)
        if len(set(s for s in slots if s >= 0)) != len([s for s in slots if s >= 0]):
            k[2], v[2] = k[1], v[1]  # duplicate real slots carry identical data
        exp_k, exp_v = k_cache.clone(), v_cache.clone()
        for row, s in enumerate(slots):
            if s >= 0:
                exp_k[s], exp_v[s] = k[row], v[row]
        write_kv_cache_ref(k, v, k_cache, v_cache, torch.tensor(slots))
        assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)


def test_align_and_router_kernels_compile_for_sm90():
    """The one-program align and the router kernels compile ahead of time for sm_90 at the launch
    shapes a GPU uses (the interpreter does not check Triton's typing rules); the MoE GEMMs'
    weight loads are pipelined there (cp.async: loads in flight while the MMA runs)."""
    import triton

    from mtpspec.ops import triton_utils
    i32 = lambda names: {n: "i32" for n in names}  # noqa: E731
    align_sig = {"ids_ptr": "*i64", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                 **i32(["num_pairs", "num_experts", "num_slots", "num_blocks"])}
    specs = [{"module": "mtpspec.ops.moe_gemm", "kernel": "_align", "signature": align_sig,
              "constexprs": dict(BLOCK_M=bm, CHUNK=moe_gemm.align_chunk(n), E_P2=triton.next_power_of_2(e + 1),
                                 FILL=1024),
              "aligned": ["ids_ptr", "sorted_ptr", "block_expert_ptr"], "num_warps": 8}
             for n, e, bm in ((8, 128, 16), (128, 256, 16), (1024, 256, 64))]
    router_sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64",
                  **i32(["num_tokens", "num_experts", "per_group", "stride_l"]), "scale": "fp32"}
    specs += [{"module": "mtpspec.ops.moe_router", "kernel": "_router", "signature": router_sig,
               "constexprs": dict(HAS_BIAS=True, TOP_K=8, K_P2=8, N_GROUP=g, G_P2=g, TOPK_GROUP=tg, TWO_PER_GROUP=True,
                                  RENORM=True, ROWS=1, BLOCK_E=triton.next_power_of_2(e), N_SHARED=ns),
               "aligned": ["logits_ptr", "bias_ptr", "w_ptr", "ids_ptr"], "num_warps": 4}
              for e, g, tg, ns in ((256, 8, 4, 1), (160, 1, 1, 0), (128, 1, 1, 2))]
    down_sig = {"inter_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "sorted_ptr": "*i32",
                "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32",
                **i32(["num_pairs", "num_experts", "hidden", "inter_size", "stride_it"]), "stride_we": "i64",
                **i32(["stride_wn", "stride_yt"])}
    specs.append({"module": "mtpspec.ops.moe_gemm", "kernel": "_down", "signature": down_sig,
                  "constexprs": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT_FP32=False, PRECISION="tf32"),
                  "aligned": [a for a in down_sig if a not in ("num_pairs", "num_experts", "topk_w_ptr")],
                  "num_warps": 4, "num_stages": 4})  # a 3-stage launch shape is in moe_gemm.LAUNCH
    specs.append({"module": "mtpspec.ops.moe_router", "kernel": "_logits",
                  "signature": {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32",
                                **i32(["num_tokens", "hidden", "num_experts", "stride_x"])},
                  "constexprs": dict(BLOCK_T=16, BLOCK_E=2, BLOCK_H=128),
                  "aligned": ["x_ptr", "w_ptr", "out_ptr", "hidden", "stride_x"], "num_warps": 4})
    specs.append({"module": "mtpspec.ops.moe_router", "kernel": "_logits_route",
                  "signature": {"x_ptr": "*bf16", "gw_ptr": "*fp32", "logits_ptr": "*fp32", "cnt_ptr": "*i32",
                                "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64",
                                **i32(["num_tokens", "hidden", "num_experts", "stride_x", "per_group"]),
                                "scale": "fp32"},
                  "constexprs": dict(BLOCK_T=1, BLOCK_E_DOT=2, BLOCK_H=1024, HAS_BIAS=True, TOP_K=8, K_P2=8, N_GROUP=8,
                                     G_P2=8, TOPK_GROUP=4, TWO_PER_GROUP=True, RENORM=True, BLOCK_E=256, N_SHARED=1),
                  "aligned": ["x_ptr", "gw_ptr", "logits_ptr", "hidden", "stride_x"], "num_warps": 4})
    specs.append({"module": "mtpspec.ops.moe_gemm", "kernel": "_sum_pairs",
                  "signature": {"y_ptr": "*fp32", "out_ptr": "*bf16", "hidden": "i32"},
                  "constexprs": dict(TOPK=9, BLOCK_H=1024, BF16_BY_BITS=False),
                  "aligned": ["y_ptr", "out_ptr", "hidden"], "num_warps": 4})
    down_spec = specs[-4]
    rank = dict(specs[-2], constexprs=dict(specs[-2]["constexprs"], BLOCK_E_DOT=1, N_GROUP=1, G_P2=1, TOPK_GROUP=1,
                                           BLOCK_E=128))  # GLM-4.5-Air's router: every expert ranked at once
    specs.append(rank)
    reports = triton_utils.compile_reports(specs, ptxas=True)
    assert len(reports) == len(specs) and down_spec["kernel"] == "_down"
    down = reports[specs.index(down_spec)]
    assert down["shared_bytes"] >= 3 * (16 * 128 + 128 * 64) * 2, down  # several stages buffered
    assert reports[-1]["spill_stores"] in (0, None), reports[-1]  # the [128, 128] ranking fits in registers
