"""Datasets, samplers and the DataLoader, with ``torch.utils.data``'s names, signatures and
behaviour: PyTorch code that uses them ports by changing its import.

The pipeline, one module each: ``dataset`` (what a sample is) -> ``sampler`` (which indices an
epoch visits) -> ``collate`` (a list of samples -> a batch) -> ``worker`` (fetching a batch,
in this process or a worker process) -> ``dataloader`` (the iteration).

Where anygpu differs: shuffling draws from a NumPy generator (``generator=`` takes an int seed
or a ``np.random.Generator``; None follows ``anygpu.manual_seed``); Python floats collate to
float32; batches are made on the default device (``ANYGPU_DEVICE``), except that a
``TensorDataset`` of device tensors gives batches on its device when ``num_workers=0``; and
``pin_memory`` changes nothing.

>>> import numpy as np
>>> from anygpu.utils.data import DataLoader, TensorDataset
>>> x = np.arange(12, dtype=np.float32).reshape(6, 2)
>>> y = np.array([0, 1, 0, 1, 0, 1])
>>> loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=0)
>>> [tuple(xb.shape) for xb, yb in loader]
[(4, 2), (2, 2)]
"""

from anygpu.utils.data.collate import default_collate, default_convert
from anygpu.utils.data.dataloader import DataLoader
from anygpu.utils.data.dataset import (ChainDataset, ConcatDataset, Dataset, IterableDataset,
                                       Subset, TensorDataset, random_split)
from anygpu.utils.data.sampler import (BatchSampler, RandomSampler, Sampler, SequentialSampler,
                                       SubsetRandomSampler, WeightedRandomSampler)
from anygpu.utils.data.worker import WorkerInfo, get_worker_info

__all__ = ["Dataset", "IterableDataset", "TensorDataset", "ConcatDataset", "ChainDataset",
           "Subset", "random_split", "Sampler", "SequentialSampler", "RandomSampler",
           "SubsetRandomSampler", "WeightedRandomSampler", "BatchSampler", "DataLoader",
           "default_collate", "default_convert", "get_worker_info", "WorkerInfo"]
