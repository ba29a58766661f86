"""A shuffling sampler whose order is a function of ``(seed, epoch)`` alone, so a resumed run sees every epoch in the
same order as an uninterrupted one (Lightning calls :meth:`EpochShuffleSampler.set_epoch` at each epoch start, also
after a resume, and forwards it through its distributed sampler wrapper)."""

from __future__ import annotations

from typing import Iterator, Sized

import torch
from torch.utils.data import RandomSampler


class EpochShuffleSampler(RandomSampler):
    """A permutation of ``range(len(data_source))`` drawn from ``torch.Generator().manual_seed(seed + epoch)``.

    Epoch 0's order is the one ``DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))`` gives.
    Outside Lightning, call :meth:`set_epoch` at each epoch start (as with ``DistributedSampler``), or every
    epoch repeats epoch 0's order.

    Args:
        data_source: the dataset (only its length is used).
        seed: the shuffle seed.
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``'s order (0-based)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        # a DataLoader draws its workers' base seed from its generator before the sampler runs: drawing it here
        # too keeps epoch 0 in the order of DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return super().__iter__()
