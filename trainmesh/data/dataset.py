"""Fixed-length samples cut from a token stream, and the held-out windows evaluation reads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np
import torch

from trainmesh.data import sampler
from trainmesh.data.shards import TokenStream

Spans = Sequence[tuple[int, int]] | None  # (start, length) of each part of a sequence to read
T = TypeVar("T")


class _Array:
    """An in-memory token array with the reading interface of :class:`TokenStream`."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.asarray(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, count: int) -> np.ndarray:
        return self.tokens[start:start + count].astype(np.int64)

    def read_many(self, windows: list[tuple[int, int]]) -> list[np.ndarray]:
        return [self.read(start, count) for start, count in windows]


class TokenDataset:
    """Sample ``i`` is tokens ``[(first+i)*T, (first+i)*T + T + 1)``: T inputs and their T
    next-token targets; ``first``/``count`` select a contiguous range of the stream's samples
    (the training part or the held-out part)."""

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int, first: int = 0,
                 count: int | None = None):
        self.tokens = tokens if hasattr(tokens, "read") else _Array(tokens)
        total = (len(self.tokens) - 1) // seq_len
        if total < 1:
            raise ValueError(f"{len(self.tokens)} tokens cannot make one sample of seq_len={seq_len}")
        self.seq_len, self.first = seq_len, first
        self.num_samples = total - first if count is None else count
        if self.num_samples < 1 or first + self.num_samples > total:
            raise ValueError(f"samples {first}:{first + self.num_samples} are outside the "
                             f"{total} samples of seq_len={seq_len} in the data")

    def batch(self, ids: np.ndarray, spans: Spans = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(ids), seq_len) int64; with ``spans`` ((start, length)
        in the sequence: a context-parallel rank's chunks) only those positions, concatenated,
        and only their tokens are read."""
        T = self.seq_len
        spans = list(spans or [(0, T)])
        got = self.tokens.read_many([((self.first + int(i)) * T + start, n + 1)
                                     for start, n in spans for i in ids])  # (all at once)
        parts = [np.stack(got[k * len(ids):(k + 1) * len(ids)]) for k in range(len(spans))]
        x = torch.cat([torch.from_numpy(p[:, :-1]) for p in parts], 1)
        y = torch.cat([torch.from_numpy(p[:, 1:]) for p in parts], 1)
        return x.contiguous(), y.contiguous()

    def microbatches(self, seed: int, step: int, global_batch_size: int, dp_rank: int, dp: int,
                     microbatch_size: int, spans: Spans = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of ``step``'s global batch, split into microbatches (of each
        sequence only ``spans``, as ``batch``)."""
        start, count = sampler.rank_slice(dp_rank, dp, global_batch_size, microbatch_size)
        ids = sampler.sample_ids(seed, step, global_batch_size, self.num_samples, start, count)
        return self._split(ids, microbatch_size, spans)

    def eval_microbatches(self, batch: int, global_batch_size: int, dp_rank: int, dp: int,
                          microbatch_size: int, spans: Spans = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of held-out batch ``batch``: windows ``batch * B ...`` in order
        (wrapping around), the same for every mesh and every evaluation."""
        start, count = sampler.rank_slice(dp_rank, dp, global_batch_size, microbatch_size)
        ids = (batch * global_batch_size + start + np.arange(count)) % self.num_samples
        return self._split(ids, microbatch_size, spans)

    def _split(self, ids: np.ndarray, size: int, spans: Spans) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.batch(ids[i:i + size], spans) for i in range(0, len(ids), size)]


class Prefetcher(Generic[T]):
    """The next step's data read in the background while this step trains, so that a step does
    not wait on reads (on an object store each window is a ranged GET). One step ahead, so its
    memory is one step's windows. Exact: ``get(step)`` returns what ``fetch(step)`` returns; a
    step asked for out of turn (a resume, a re-form) is read at once, the read ahead dropped."""

    def __init__(self, fetch: Callable[[int], T]):
        self._fetch = fetch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainmesh-data")
        self._ahead: tuple[int, Future] | None = None

    def get(self, step: int) -> T:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            out = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()
            out = self._fetch(step)
        self._ahead = (step + 1, self._pool.submit(self._fetch, step + 1))
        return out

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def open_datasets(data_dir: str, seq_len: int, eval_path: str | None = None,
                  eval_fraction: float = 0.0) -> tuple[TokenDataset, TokenDataset | None]:
    """(training, held-out) datasets: the held-out part is ``eval_path``'s dataset, or the
    last ``eval_fraction`` of ``data_dir``'s samples (then never trained on), or none."""
    stream = TokenStream(data_dir)
    if eval_path:
        return TokenDataset(stream, seq_len), TokenDataset(TokenStream(eval_path), seq_len)
    if eval_fraction <= 0:
        return TokenDataset(stream, seq_len), None
    total = (len(stream) - 1) // seq_len
    held = max(1, round(total * eval_fraction))
    if held >= total:
        raise ValueError(f"data.eval_fraction={eval_fraction} leaves no training samples of the "
                         f"{total} in the data; lower it")
    return TokenDataset(stream, seq_len, 0, total - held), TokenDataset(stream, seq_len, total - held, held)
