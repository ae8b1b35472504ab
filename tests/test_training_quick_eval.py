"""Greedy speculative-decoding simulation: lossless output, acceptance accounting and the MTP
input wiring (rows, positions, recycled hidden states), with fake models of known behaviour."""

import pytest
import torch

from mtpspec.training.quick_eval import simulate_greedy_spec_decode

V = 23
EOT = 0


def g(x: int) -> int:
    """The target's greedy next token depends only on the current token."""
    return (x * 5 + 3) % V or 1  # never EOT


class FakeTarget:
    def __call__(self, ids, positions):
        assert positions.tolist() == list(range(len(ids)))
        return torch.nn.functional.one_hot(torch.tensor([g(int(x)) for x in ids]), V).float()

    def compute_logits(self, h):
        return h


def _draft(x: int) -> int:
    return g(x) if x % 4 else (g(x) + 1) % V or 1


class FakeMTP:
    """Drafts g(token) from the row's token, wrong (g + 1) when the token is divisible by 4.
    Checks its inputs: positions 0..rows-1, and row r's previous hidden state comes from the
    token of row r - 1 (the target's g(t_r), or for draft rows the MTP's own previous output)."""

    def __call__(self, ids, positions, prev, spec_step_idx=0):
        assert positions.tolist() == list(range(len(ids))) and prev.shape == (len(ids), V)
        out = [_draft(int(x)) for x in ids]
        for r in range(1, len(ids)):
            assert int(prev[r].argmax()) in (g(int(ids[r - 1])), out[r - 1])
        return torch.nn.functional.one_hot(torch.tensor(out), V).float()

    def compute_logits(self, h, spec_step_idx=0):
        return h


def _expected(prompt_last: int, k: int, max_new: int):
    chain, x = [], prompt_last
    for _ in range(max_new + k + 2):
        x = g(x)
        chain.append(x)
    i, steps, per_pos = 0, 0, [0] * k
    while i < max_new:
        steps += 1
        if i + 1 >= max_new:
            i += 1
            break
        a, tok = 0, chain[i]
        while a < k:
            draft = _draft(tok)
            if draft != chain[i + 1 + a]:
                break
            per_pos[a] += 1
            tok = draft
            a += 1
        i += 1 + a
    return chain[:max_new], steps, per_pos


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("prompt", [[7], [5, 9, 2], [4, 4, 12, 1]])
def test_simulation_is_lossless_and_counts_acceptance(k, prompt):
    max_new = 30
    r = simulate_greedy_spec_decode(FakeTarget(), FakeMTP(), prompt, k, max_new, EOT, torch.device("cpu"))
    chain, steps, per_pos = _expected(prompt[-1], k, max_new)
    assert r["tokens"] == chain  # identical to plain greedy decoding of the target
    assert r["steps"] == steps
    assert r["per_position"] == per_pos
    assert sum(r["accepted"]) == sum(per_pos)
