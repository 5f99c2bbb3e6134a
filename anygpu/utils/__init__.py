"""Utilities beside the tensor library: ``anygpu.utils.data`` loads datasets in batches, as
``torch.utils.data`` does.

>>> from anygpu.utils.data import DataLoader
>>> [b.tolist() for b in DataLoader(range(5), batch_size=2)]
[[0, 1], [2, 3], [4]]
"""

from anygpu.utils import data

__all__ = ["data"]
