"""rotary_embedding: the Triton kernel (interpreter on CPU, or the GPU) equals the torch reference
bit for bit; the reference matches float64 RoPE and Hugging Face's ``apply_rotary_pos_emb``."""

import pytest
import torch

from mtpspec.layers.rotary_embedding import RotaryEmbedding
from mtpspec.ops import rotary as rotary_mod
from mtpspec.ops.rotary import rotary_embedding, rotary_embedding_ref

# (heads, kv heads, head_size, rotary_dim): GLM-4.5 (partial 0.5), Llama (full), DeepSeek's rope
# part (64 of 64, one key head), odd head counts past one head block, a rest that is no power of 2.
SHAPES = [(12, 2, 128, 64), (4, 4, 64, 64), (3, 1, 64, 64), (17, 3, 32, 16), (2, 1, 40, 24)]


def _inputs(t, nh, nkv, hs, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hs, generator=g) * 3).to(dtype).to(device)
    q, k, _ = qkv.split([nh * hs, nkv * hs, nkv * hs], dim=-1)  # strided rows, as a fused qkv gives
    pos = torch.randint(0, 4096, (t,), generator=g).to(device)
    return pos, q, k


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference_bitwise(kdev, shape, neox):
    dtype = torch.bfloat16
    nh, nkv, hs, rot = shape
    rope = RotaryEmbedding(hs, rot, 4096, 10000.0, is_neox_style=neox).to(kdev)
    for t in (1, 5, 33):
        pos, q, k = _inputs(t, nh, nkv, hs, dtype, kdev, seed=t)
        got_q, got_k = rotary_embedding(pos, q, k, rope.cos_sin_cache, hs, rot, neox)
        want_q, want_k = rotary_embedding_ref(pos, q, k, rope.cos_sin_cache, hs, rot, neox)
        assert got_q.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape
        assert torch.equal(got_q.view(torch.int16), want_q.view(torch.int16))
        assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
        assert torch.equal(rope.forward_key(pos, k), want_k)


def test_kernel_is_launched(interp, monkeypatch):
    calls = []
    real = rotary_mod._rope

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    monkeypatch.setattr(rotary_mod, "_rope", Spy())
    rope = RotaryEmbedding(128, 64, 4096, 10000.0)
    pos, q, k = _inputs(3, 12, 2, 128, torch.bfloat16, "cpu")
    rope(pos, q, k)
    assert calls == [(3, 1 + 1)]  # 12 query heads: one block of 16; 2 key heads: one block
    rope(pos, q.float(), k.float())  # fp32 and fp16 keep the torch path
    rope(pos, q.half(), k.half())
    assert len(calls) == 1


@pytest.mark.parametrize("neox", [True, False])
def test_reference_matches_float64_rope(no_interp, neox):
    nh, nkv, hs, rot = 4, 2, 64, 32
    rope = RotaryEmbedding(hs, rot, 4096, 10000.0, is_neox_style=neox)
    pos, q, k = _inputs(7, nh, nkv, hs, torch.float32, "cpu")
    got_q, _ = rope(pos, q, k)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    ang = (pos.float()[:, None] * inv[None]).double()  # the angles in fp32, as Hugging Face forms them
    x = q.double().view(7, nh, hs)
    if neox:
        a, b = x[..., :rot // 2], x[..., rot // 2:rot]
    else:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    ra, rb = a * c - b * s, b * c + a * s
    want = x.clone()
    if neox:
        want[..., :rot // 2], want[..., rot // 2:rot] = ra, rb
    else:
        want[..., 0:rot:2], want[..., 1:rot:2] = ra, rb
    torch.testing.assert_close(got_q.double().view(7, nh, hs), want, rtol=1e-5, atol=1e-5)


def test_reference_matches_hugging_face(no_interp):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    hs = 64
    rope = RotaryEmbedding(hs, hs, 4096, 10000.0)
    pos, q, k = _inputs(6, 4, 2, hs, torch.bfloat16, "cpu")
    got_q, got_k = rope(pos, q, k)
    half = rope.cos_sin_cache[pos][:, :hs // 2], rope.cos_sin_cache[pos][:, hs // 2:]
    cos = torch.cat([half[0], half[0]], -1)[None].to(torch.bfloat16)
    sin = torch.cat([half[1], half[1]], -1)[None].to(torch.bfloat16)
    hq, hk = apply_rotary_pos_emb(q.reshape(6, 4, hs).transpose(0, 1)[None], k.reshape(6, 2, hs).transpose(0, 1)[None],
                                  cos, sin)
    assert torch.equal(got_q, hq[0].transpose(0, 1).reshape(6, 4 * hs))
    assert torch.equal(got_k, hk[0].transpose(0, 1).reshape(6, 2 * hs))


def test_bad_shapes_name_what_is_wrong():
    rope = RotaryEmbedding(64, 32, 128, 10000.0)
    pos, q, k = _inputs(3, 2, 1, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="must be"):
        rotary_embedding(pos[:2], q, k, rope.cos_sin_cache, 64, 32, True)
    with pytest.raises(ValueError, match="multiples of head_size"):
        rotary_embedding(pos, q[:, :100], k, rope.cos_sin_cache, 64, 32, True)


def test_strided_and_expanded_positions(kdev):
    """Positions of any stride: a strided view and an expanded scalar give the reference's rows
    (the kernel once read them at unit stride: wrong rows, or past an expanded buffer)."""
    nh, nkv, hs, rot = 4, 2, 64, 32
    rope = RotaryEmbedding(hs, rot, 4096, 10000.0).to(kdev)
    _, q, k = _inputs(6, nh, nkv, hs, torch.bfloat16, kdev)
    for pos in ((torch.arange(12, device=kdev) * 100)[::2], torch.tensor([7], device=kdev).expand(6),
                torch.arange(12, device=kdev, dtype=torch.int32).view(6, 2)[:, 1]):
        got = rotary_embedding(pos, q, k, rope.cos_sin_cache, hs, rot, True)
        want = rotary_embedding_ref(pos.contiguous(), q, k, rope.cos_sin_cache, hs, rot, True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_subnormal_and_special_values_bitwise(kdev):
    """bf16 subnormals, products that round into the subnormal range, +-inf, -0.0, max: bit for
    bit (bf16 inputs are widened by their bits; the interpreter's bf16 -> fp32 conversion is wrong
    for subnormals). NaNs compare as NaNs (torch canonicalises their payloads)."""
    hs, rot = 16, 16
    rope = RotaryEmbedding(hs, rot, 64, 10000.0).to(kdev)
    bits = torch.tensor([0x0001, 0x0040, 0x0060, 0x8040, 0x007F, 0x8001, 0x0080, 0x00C0, 0x7F80, 0xFF80, 0x8000,
                         0x7F7F, 0xFF7F, 0x0D00, 0x3F80, 0x0000], dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).repeat(8, 2)  # 8 rows, 2 heads of 16
    x[:, 16:] = (torch.tensor(1.5e-38) * torch.arange(1, 17)).to(torch.bfloat16)
    x = x.to(kdev)
    pos = torch.arange(8, device=kdev)
    got_q, got_k = rotary_embedding(pos, x, x[:, :16], rope.cos_sin_cache, hs, rot, True)
    want_q, want_k = rotary_embedding_ref(pos, x, x[:, :16], rope.cos_sin_cache, hs, rot, True)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_cache_checks_and_cache_gradients():
    rope = RotaryEmbedding(64, 32, 128, 10000.0)
    pos, q, k = _inputs(3, 2, 1, 64, torch.bfloat16, "cpu")
    pos = pos % 128
    for bad in (rope.cos_sin_cache[:, :16], rope.cos_sin_cache[0], torch.zeros(128, 64)):
        with pytest.raises(ValueError, match=r"cos_sin_cache must be \[max_position, rotary_dim=32\]"):
            rotary_embedding(pos, q, k, bad, 64, 32, True)
    with pytest.raises(ValueError, match=r"head_size=0 \(> 0\)"):
        rotary_embedding(pos, q, k, rope.cos_sin_cache, 0, 32, True)
    cache = rope.cos_sin_cache.clone().requires_grad_()
    out_q, _ = rotary_embedding(pos, q, k, cache, 64, 32, True)  # a learnable table: the autograd path
    assert out_q.grad_fn is not None
