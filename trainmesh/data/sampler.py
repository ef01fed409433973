"""The deterministic, resumable sampler: a pure function of (seed, step, global sample index).

Global sample ``g = step * global_batch_size + j`` is drawn from epoch ``g // N`` at position
``g % N`` of that epoch's permutation of the N samples. A DP rank reads a contiguous slice of
the global batch, in whole microbatches (shares differ by at most one microbatch when dp does
not divide their number), so the union over ranks is the same global batch, cut into the same
microbatches, for every DP degree, and a resumed run at any DP degree reads exactly what the
uninterrupted run would have.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def sample_ids(seed: int, step: int, global_batch_size: int, num_samples: int,
               start: int = 0, count: int | None = None) -> np.ndarray:
    """Dataset sample ids for positions ``start:start+count`` of the global batch of ``step``."""
    count = global_batch_size - start if count is None else count
    if start < 0 or count < 0 or start + count > global_batch_size:
        raise ValueError(f"slice {start}:{start + count} is outside a batch of {global_batch_size}")
    g = step * global_batch_size + start + np.arange(count)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(g // num_samples):
        sel = g // num_samples == epoch
        out[sel] = _epoch_permutation(seed, int(epoch), num_samples)[g[sel] % num_samples]
    return out


def rank_slice(dp_rank: int, dp: int, global_batch_size: int,
               microbatch_size: int = 1) -> tuple[int, int]:
    """(start, count) in samples of a DP rank's contiguous share of the global batch: the
    batch's microbatches dealt out in order, the first ``M % dp`` ranks taking one more."""
    if global_batch_size % microbatch_size:
        raise ValueError(f"global batch {global_batch_size} is not divisible by "
                         f"microbatch_size={microbatch_size}")
    micro = global_batch_size // microbatch_size
    if not 0 <= dp_rank < dp or dp > micro:
        raise ValueError(f"dp rank {dp_rank} of {dp}: the global batch holds {micro} microbatches")
    per, extra = divmod(micro, dp)
    first = dp_rank * per + min(dp_rank, extra)
    return first * microbatch_size, (per + (dp_rank < extra)) * microbatch_size
