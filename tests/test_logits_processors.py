"""logit_bias, min_tokens and the presence / frequency / repetition penalties on the target's logits.

References: a float64 brute force written from vLLM's definitions row by row; the penalised
rows of a ``1 + k`` verification block against ``k + 1`` single rows (plain decoding) that
carry the drafts as output tokens; and the rejection sampler's statistical check
(``test_rejection_sampler``): emitted tokens follow the *penalised* target distribution.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from test_rejection_sampler import P_VALUE_FLOOR, _slot_p_values, chi_square_p_value, reference_probs

from mtpspec.sample.logits_processors import LogitsProcessorMetadata, SeqLogitsParams, apply_logits_processors
from mtpspec.sample.rejection_sampler import RejectionSampler
from mtpspec.sample.sampler import Sampler, SamplingMetadata

CPU = torch.device("cpu")
EOS = 2


def brute_force(row: torch.Tensor, p: SeqLogitsParams, extra_outputs=(), row_index: int = 0) -> np.ndarray:
    """One row in float64, from the definitions (vLLM's order: bias, min_tokens, repetition,
    frequency, presence); ``extra_outputs`` are drafts counted as output tokens."""
    x = row.double().numpy().copy()
    for t, b in p.logit_bias:
        x[t] += b
    if row_index < p.min_tokens_remaining:
        for t in p.suppressed_token_ids:
            x[t] = -math.inf
    if p.uses_penalties:
        outputs = list(p.output_token_ids) + list(extra_outputs)
        counts = np.bincount(np.asarray(outputs, dtype=np.int64), minlength=len(x)) if outputs else np.zeros(len(x))
        for t in range(len(x)):
            if p.repetition_penalty != 1.0 and (counts[t] > 0 or t in p.prompt_token_ids):
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
            x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return x


PARAMS = [
    SeqLogitsParams(presence_penalty=0.7, output_token_ids=[1, 4, 4, 9]),
    SeqLogitsParams(frequency_penalty=-0.5, output_token_ids=[3, 3, 3, 0]),
    SeqLogitsParams(repetition_penalty=1.8, output_token_ids=[5, 6], prompt_token_ids=[0, 7, 11]),
    SeqLogitsParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=1.5,
                    output_token_ids=[2, 8, 8], prompt_token_ids=[8, 10]),
    SeqLogitsParams(logit_bias=[(3, 5.0), (7, -100.0)]),
    SeqLogitsParams(min_tokens_remaining=2, suppressed_token_ids=[EOS, 5]),
    SeqLogitsParams(repetition_penalty=1.3, frequency_penalty=0.4, logit_bias=[(EOS, 3.0)],
                    min_tokens_remaining=1, suppressed_token_ids=[EOS], output_token_ids=[EOS + 1]),
]


@pytest.mark.parametrize("k", [0, 3])
def test_rows_equal_float64_brute_force(k: int) -> None:
    """Every parameter alone and mixed, over a decode block (k = 3: drafts counted per row) or one row."""
    g = torch.Generator().manual_seed(5 + k)
    vocab = 13
    nrow = k + 1
    logits = torch.randn(len(PARAMS) * nrow + 2, vocab, generator=g) * 3  # 2 untouched rows at the end
    drafts = torch.randint(0, vocab, (len(PARAMS), k), generator=g).tolist()
    items = [(list(range(i * nrow, (i + 1) * nrow)), drafts[i], p) for i, p in enumerate(PARAMS)]
    out = apply_logits_processors(logits, LogitsProcessorMetadata.build(items, CPU))
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for i, p in enumerate(PARAMS):
        for j in range(nrow):
            r = i * nrow + j
            ref = brute_force(logits[r], p, drafts[i][:j], j)
            got = out[r].double().numpy()
            assert np.array_equal(np.isinf(ref), np.isinf(got)), (i, j)
            fin = np.isfinite(ref)
            np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-6, atol=1e-5, err_msg=f"params {i} row {j}")
    assert torch.equal(out[-2:], logits[-2:])  # other rows unchanged


def test_inputs_untouched_and_noop_is_none() -> None:
    logits = torch.randn(3, 9)
    keep = logits.clone()
    assert LogitsProcessorMetadata.build([([0], [], SeqLogitsParams())], CPU) is None
    assert LogitsProcessorMetadata.build([([0], [], SeqLogitsParams(min_tokens_remaining=3))], CPU) is None
    assert apply_logits_processors(logits, None) is logits
    meta = LogitsProcessorMetadata.build([([1], [], SeqLogitsParams(presence_penalty=1.0, output_token_ids=[4]))],
                                         CPU)
    out = apply_logits_processors(logits, meta)
    assert torch.equal(logits, keep) and out[1, 4] == keep[1, 4] - 1.0
    with pytest.raises(ValueError, match="drafts"):
        LogitsProcessorMetadata.build([([0, 1, 2], [3], SeqLogitsParams(logit_bias=[(1, 1.0)]))], CPU)


@pytest.mark.parametrize("k", [1, 3])
def test_verify_block_rows_equal_plain_decoding_rows(k: int) -> None:
    """Row j of a 1 + k block == the single row plain decoding scores after emitting drafts[:j]
    (bit for bit: the same float ops per row)."""
    g = torch.Generator().manual_seed(k)
    vocab = 17
    logits = torch.randn(k + 1, vocab, generator=g) * 2
    drafts = [4, 4, 9][:k]
    base = dict(presence_penalty=0.3, frequency_penalty=0.9, repetition_penalty=1.4, prompt_token_ids=[1, 9],
                logit_bias=[(4, 1.5)], suppressed_token_ids=[EOS])
    outputs = [4, 7]
    block = apply_logits_processors(logits, LogitsProcessorMetadata.build(
        [(list(range(k + 1)), drafts, SeqLogitsParams(output_token_ids=outputs, min_tokens_remaining=2, **base))],
        CPU))
    for j in range(k + 1):
        single = SeqLogitsParams(output_token_ids=outputs + drafts[:j], min_tokens_remaining=max(0, 2 - j), **base)
        row = apply_logits_processors(logits[j:j + 1], LogitsProcessorMetadata.build([([0], [], single)], CPU))
        assert torch.equal(block[j], row[0]), j


def _meta(n: int, temperature: float) -> SamplingMetadata:
    return SamplingMetadata.build([temperature] * n, [0] * n, [1.0] * n, CPU)


def test_min_tokens_rejects_an_eos_draft_greedy() -> None:
    """The target's raw argmax is EOS in every row and every draft is EOS: rows before min_tokens
    must not accept it (greedy: the argmax with EOS masked), later rows do."""
    vocab, k = 8, 3
    logits = torch.zeros(4, k + 1, vocab)
    logits[..., EOS] = 5.0
    logits[..., 6] = 4.0  # second best
    drafts = torch.full((4, k), EOS)
    # sequence b has min_tokens_remaining = b: rows j < b mask EOS
    items = [(list(range(b * (k + 1), (b + 1) * (k + 1))), [EOS] * k,
              SeqLogitsParams(min_tokens_remaining=b, suppressed_token_ids=[EOS])) for b in range(4)]
    flat = apply_logits_processors(logits.view(-1, vocab), LogitsProcessorMetadata.build(items, CPU))
    res = RejectionSampler()(drafts, flat.view(4, k + 1, vocab), _meta(4, 0.0))
    assert res.num_accepted.tolist() == [3, 0, 0, 0]
    assert res.output_token_ids[0].tolist() == [EOS] * 4            # no minimum: all accepted + bonus EOS
    for b in (1, 2, 3):                                              # first row masked: EOS draft rejected
        assert res.output_token_ids[b, 0].item() == 6
    # plain decoding (k = 0) of the masked first row picks the same token
    one = apply_logits_processors(logits[1, :1], LogitsProcessorMetadata.build(
        [([0], [], SeqLogitsParams(min_tokens_remaining=1, suppressed_token_ids=[EOS]))], CPU))
    assert Sampler()(one, _meta(1, 0.0), torch.zeros(1, dtype=torch.float64)).item() == 6


@pytest.mark.parametrize("case", ["penalties", "min_tokens"])
def test_rejection_sampling_is_exact_for_the_edited_distribution(case: str) -> None:
    """One-hot drafts, 30000 verifications: the token emitted at slot j follows the penalised /
    masked target distribution of row j (brute force, float64), not the raw one."""
    draws, k, vocab, temperature = 30000, 3, 7, 0.9
    g = torch.Generator().manual_seed(41 if case == "penalties" else 42)
    raw = torch.randn(k + 1, vocab, generator=g) * 1.5
    raw[:, EOS] += 2.0  # EOS likely (so masking it matters)
    if case == "penalties":
        p = SeqLogitsParams(presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.6,
                            output_token_ids=[0, 3, 3], prompt_token_ids=[5], logit_bias=[(4, 1.0)])
    else:
        p = SeqLogitsParams(min_tokens_remaining=2, suppressed_token_ids=[EOS])
    no_eos = raw.clone()
    no_eos[:, EOS] = -math.inf
    order = no_eos.argsort(dim=-1, descending=True)
    drafts = [int(order[j, j % 2]) for j in range(k)]  # as in test_rejection_sampler: likely and less likely
    if case == "min_tokens":
        drafts[1] = EOS  # row 1 still has EOS masked: the draft can never be accepted
    edited = torch.stack([torch.from_numpy(brute_force(raw[j], p, drafts[:j], j)) for j in range(k + 1)])
    target = reference_probs(edited, temperature, 0, 1.0)
    block = apply_logits_processors(raw, LogitsProcessorMetadata.build([(list(range(k + 1)), drafts, p)], CPU))
    rows = block.unsqueeze(0).expand(draws, k + 1, vocab)
    d = torch.tensor(drafts).unsqueeze(0).expand(draws, k).clone()
    res = RejectionSampler()(d, rows, _meta(draws, temperature), torch.rand(draws, k, generator=g, dtype=torch.float64),
                             torch.rand(draws, k + 1, generator=g, dtype=torch.float64))
    reached = 2 if case == "min_tokens" else k + 1  # slots any draw reaches
    pvals = _slot_p_values(res.output_token_ids, res.num_accepted, target[:reached])
    assert min(pvals) > P_VALUE_FLOOR, pvals
    raw_target = reference_probs(raw, temperature, 0, 1.0)
    assert _slot_p_values(res.output_token_ids, res.num_accepted, raw_target[:1])[0] < 1e-12  # the check has power
    if case == "min_tokens":
        assert (res.output_token_ids[:, :2] != EOS).all()
        assert res.num_accepted.max() == 1 and (res.num_accepted == 1).sum() > 1000  # EOS draft never accepted


def test_plain_sampler_follows_the_edited_distribution() -> None:
    g = torch.Generator().manual_seed(8)
    vocab, n = 9, 40000
    logits = torch.randn(1, vocab, generator=g) * 2
    p = SeqLogitsParams(frequency_penalty=0.8, repetition_penalty=1.5, output_token_ids=[int(logits.argmax())] * 2,
                        logit_bias=[(0, -2.0)], min_tokens_remaining=1, suppressed_token_ids=[EOS])
    edited = torch.from_numpy(brute_force(logits[0], p)).unsqueeze(0)
    target = reference_probs(edited, 1.1, 0, 1.0)[0]
    x = apply_logits_processors(logits.expand(n, vocab), LogitsProcessorMetadata.build(
        [([r], [], p) for r in range(n)], CPU))
    toks = Sampler()(x, _meta(n, 1.1), torch.rand(n, generator=g, dtype=torch.float64))
    assert chi_square_p_value(np.bincount(toks.numpy(), minlength=vocab), target) > P_VALUE_FLOOR


def test_no_host_sync() -> None:
    """The edits and the logprob scoring run on device tensors only (the index tensors are built
    on the host beforehand): nothing in them waits for the device."""
    from test_paged_attention import no_host_sync

    from mtpspec.sample.logprobs import score_rows
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 13, generator=g)
    items = [(list(range(i * 4, (i + 1) * 4)), [1, 2, 3], p) for i, p in enumerate(PARAMS[2:4])]
    meta = LogitsProcessorMetadata.build(items, CPU)
    chosen = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    with torch.inference_mode(), no_host_sync():
        out = apply_logits_processors(logits, meta)
        block = score_rows(logits, chosen, 3)
    assert out.shape == logits.shape and block.shape == (8, 8)
