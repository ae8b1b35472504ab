"""VocabParallelEmbedding / ParallelLMHead on gloo ranks (tp 1..4), uneven and mostly-padding shards.

References: the padding rule recomputed from the spec with ``math.ceil``, shard membership by
brute force over every id, and ``F.embedding`` on the full single-process weight (the sharded
result must be bit-identical: exactly one rank contributes each row).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F

from mtpspec.distributed import get_tensor_model_parallel_rank, launch
from mtpspec.layers import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding

H = 12
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(fn: Callable[..., Any], tp: int, *args: Any) -> List[Any]:
    return [fn(*args)] if tp == 1 else launch(fn, tp, *args)


def vocab_sizes(tp: int) -> List[int]:
    """Including V < tp * 64 (trailing all-padding ranks) and V = k * 64 * tp + 1 (1 real row on the last rank)."""
    return sorted({1, 63, 64, 65, 130, 1000, 3 * 64 * tp + 1})


def token_counts(tp: int) -> List[int]:
    return sorted({0, 1, tp - 1, tp + 1, 17, 4 * (1 + 3), 16 * (1 + 5)})


def _case(seed: int, tp: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    c: Dict[str, Any] = {"seed": seed, "tp": tp, "W": {}, "ids": {}, "bias": {}}
    for v in vocab_sizes(tp):
        c["W"][v] = torch.randn(v, H, generator=g)
        c["bias"][v] = torch.randn(v, generator=g)
        c["ids"][v] = {n: torch.randint(0, v, (n,), generator=g) for n in token_counts(tp)}
        c["ids"][v]["2d"] = torch.randint(0, v, (3, 5), generator=g)
    c["h"] = torch.randn(7, H, generator=g)
    return c


def _catch(f: Callable[[], Any]) -> str:
    try:
        f()
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _rank(c: Dict[str, Any]) -> Dict[str, Any]:
    res: Dict[str, Any] = {"rank": get_tensor_model_parallel_rank()}
    for v, w in c["W"].items():
        for dtype in DTYPES:
            emb = VocabParallelEmbedding(v, H, params_dtype=dtype)
            emb.weight.weight_loader(emb.weight, w)
            res[("attrs", v)] = (emb.org_vocab_size, emb.num_embeddings_padded, emb.num_embeddings_per_partition,
                                 emb.vocab_start_index, emb.vocab_end_index, emb.num_real_embeddings_per_partition)
            res[("weight", v, dtype)] = emb.weight.detach().clone()
            for n, ids in c["ids"][v].items():
                res[("emb", v, dtype, n)] = emb(ids)
            res[("emb_int32", v, dtype)] = emb(c["ids"][v]["2d"].to(torch.int32))
        emb = VocabParallelEmbedding(v, H)
        emb.weight.weight_loader(emb.weight, w)
        bad = torch.tensor([0, v, v - 1, -1, v + 1000])
        res[("oob", v)] = _catch(lambda: emb(bad))
        res[("oob_neg", v)] = _catch(lambda: emb(torch.tensor([-5])))
        res[("oob_unchecked", v)] = VocabParallelEmbedding(v, H, validate_ids=False)(bad)  # zero weights anyway
        unchecked = VocabParallelEmbedding(v, H, validate_ids=False)
        unchecked.weight.weight_loader(unchecked.weight, w)
        res[("oob_unchecked_loaded", v)] = unchecked(bad)
        res[("float_ids", v)] = _catch(lambda: emb(torch.zeros(3)))
        fresh = VocabParallelEmbedding(v, H)  # (a [padded, H] load succeeds when padded == V)
        res[("load_padded_shape", v)] = _catch(
            lambda: fresh.weight.weight_loader(fresh.weight, torch.zeros(fresh.num_embeddings_padded, H)))
        res[("load_shard_shape", v)] = _catch(
            lambda: fresh.weight.weight_loader(fresh.weight, torch.zeros(fresh.num_embeddings_per_partition, H + 1)))
        # A tied LM head computes logits with the embedding's weight; a biased head loads its bias shard.
        head = ParallelLMHead(v, H).tie_weights(emb)
        res[("tied_same_object", v)] = head.weight is emb.weight
        res[("tied_logits", v)] = LogitsProcessor(v).compute_logits(head, c["h"])
        biased = ParallelLMHead(v, H, bias=True)
        biased.weight.weight_loader(biased.weight, w)
        biased.bias.weight_loader(biased.bias, c["bias"][v])
        res[("bias_shard", v)] = biased.bias.detach().clone()
        res[("biased_logits", v)] = LogitsProcessor(v).compute_logits(biased, c["h"])
    v0 = vocab_sizes(c["tp"])[-1]
    res["tie_mismatch"] = _catch(lambda: ParallelLMHead(v0 + 1, H).tie_weights(VocabParallelEmbedding(v0, H)))
    res["head_forward"] = _catch(lambda: ParallelLMHead(v0, H)(torch.tensor([0])))
    return res


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_vocab_parallel_embedding_and_head(tp: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    c = _case(seed, tp)
    results = _run(_rank, tp, c)
    for rank, res in enumerate(results):
        ctx = f"seed={seed} tp={tp} rank={rank}"
        assert res["rank"] == rank
        for v, w in c["W"].items():
            per = math.ceil(v / (64 * tp)) * 64
            start, end = rank * per, (rank + 1) * per
            real = sum(1 for i in range(v) if start <= i < end)
            assert res[("attrs", v)] == (v, per * tp, per, start, end, real), ctx
            for dtype in DTYPES:
                wd = w.to(dtype)
                shard = res[("weight", v, dtype)]
                assert shard.dtype == dtype and shard.shape == (per, H), ctx
                assert torch.equal(shard[:real], wd[start:start + real]), f"{ctx} V={v} real rows"
                assert torch.equal(shard[real:], torch.zeros(per - real, H, dtype=dtype)), f"{ctx} V={v} padding rows"
                for n, ids in c["ids"][v].items():
                    out = res[("emb", v, dtype, n)]
                    assert torch.equal(out, F.embedding(ids, wd)), f"{ctx} V={v} {dtype} n={n}"
                assert torch.equal(res[("emb_int32", v, dtype)], F.embedding(c["ids"][v]["2d"], wd))
            oob = res[("oob", v)]
            assert oob.startswith("ValueError") and f"token id {v} is out of range [0, {v})" in oob, oob
            assert "3 bad ids" in oob, oob
            assert res[("oob_neg", v)].startswith("ValueError") and "-5" in res[("oob_neg", v)]
            expected = F.embedding(torch.tensor([0, 0, v - 1, 0, 0]), w)
            expected[[1, 3, 4]] = 0  # unchecked out-of-range ids embed to zeros
            assert torch.equal(res[("oob_unchecked_loaded", v)], expected), ctx
            assert torch.equal(res[("oob_unchecked", v)], torch.zeros(5, H))
            assert res[("float_ids", v)].startswith("TypeError") and "integer" in res[("float_ids", v)]
            if per * tp != v:
                msg = res[("load_padded_shape", v)]
                assert msg.startswith("ValueError") and str([v, H]) in msg and str([per * tp, H]) in msg, msg
            assert res[("load_shard_shape", v)].startswith("ValueError")
            assert res[("tied_same_object", v)] is True
            ref = c["h"].double() @ w.double().T
            torch.testing.assert_close(res[("tied_logits", v)].double(), ref, atol=1e-4, rtol=1e-4)
            b = res[("bias_shard", v)]
            assert torch.equal(b[:real], c["bias"][v][start:start + real]) and not b[real:].any()
            torch.testing.assert_close(res[("biased_logits", v)].double(), ref + c["bias"][v].double(),
                                       atol=1e-4, rtol=1e-4)
        assert res["tie_mismatch"].startswith("ValueError") and "does not match" in res["tie_mismatch"]
        assert res["head_forward"].startswith("RuntimeError")
