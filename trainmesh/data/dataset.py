"""Fixed-length training samples cut from a token stream."""

from __future__ import annotations

import numpy as np
import torch

from trainmesh.data import sampler


class TokenDataset:
    """Sample ``i`` is tokens ``[i*T, i*T + T + 1)``: T inputs and their T next-token targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot make one sample of seq_len={seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len

    def batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(ids), seq_len) int64."""
        T = self.seq_len
        rows = np.stack([self.tokens[i * T: i * T + T + 1] for i in ids])
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def microbatches(self, seed: int, step: int, global_batch_size: int, dp_rank: int, dp: int,
                     microbatch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of ``step``'s global batch, split into microbatches."""
        start, count = sampler.rank_slice(dp_rank, dp, global_batch_size)
        ids = sampler.sample_ids(seed, step, global_batch_size, self.num_samples, start, count)
        return [self.batch(ids[i:i + microbatch_size]) for i in range(0, count, microbatch_size)]
