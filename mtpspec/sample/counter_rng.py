"""Counter-based uniforms: the random draw for token position ``i`` of a request with seed ``s``.

Every random decision the engine makes is keyed by ``(seed, position, stream)`` and computed on
the host with numpy's wrapping ``uint64`` arithmetic, so it is

* reproducible per request, whatever else shares the batch and after preemption (recompute);
* identical on every tensor-parallel rank without communication;
* free of device synchronisation (the values travel with the step's other inputs).

The mixer is SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014, section 3), applied twice: ``h = mix(seed_hash ^ mix(position * 4 +
stream))``; the top 53 bits give a float64 in ``[0, 1)``.

Streams: :data:`STREAM_SAMPLE` for drawing a token (plain sampling; with one-hot drafts also the
verification, which draws the position's token as plain sampling would and accepts a draft iff
it equals it, see :func:`~mtpspec.sample.rejection_sampler.random_verify`);
:data:`STREAM_ACCEPT` for the accept test of drafts that come with draft probabilities.
Re-using ``(seed, position)`` across steps is sound: a position's draws decide at most one
emitted token, and draws at positions that were not decided in a step influenced nothing. Since
the token at a position is a function of ``(seed, position, logits)`` only, a seeded request
gives the same tokens with or without drafts, for any k, and after a preemption (whose
recompute drops the pending drafts).
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

STREAM_ACCEPT = 0
STREAM_SAMPLE = 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 output function on a ``uint64`` array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def seed_to_u64(seed: int) -> int:
    """Any Python int (negative or > 64 bits) to a well-mixed 64-bit key."""
    return int(splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0])


def counter_uniforms(seed_keys: Union[Sequence[int], np.ndarray], positions: np.ndarray,
                     stream: int) -> np.ndarray:
    """Uniforms in ``[0, 1)`` for each (request, position).

    Args:
        seed_keys: ``[num_rows]`` keys from :func:`seed_to_u64`, one per row.
        positions: ``[num_rows, m]`` int64 token positions (>= 0): the position of the token
            each draw decides.
        stream: :data:`STREAM_ACCEPT` or :data:`STREAM_SAMPLE`.

    Returns:
        ``[num_rows, m]`` float64 array in ``[0, 1)``.
    """
    keys = np.asarray(seed_keys, dtype=np.uint64).reshape(-1, 1)
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim != 2 or pos.shape[0] != keys.shape[0]:
        raise ValueError(f"positions must be [num_rows={keys.shape[0]}, m], got shape {pos.shape}")
    if (pos < 0).any():
        raise ValueError("positions must be >= 0")
    ctr = pos.astype(np.uint64) * np.uint64(4) + np.uint64(stream)
    h = splitmix64(keys ^ splitmix64(ctr))
    return (h >> np.uint64(11)).astype(np.float64) * (2.0 ** -53)
