"""Input pipeline: loader building, device-side augmentation, length bucketing, memory-mapped
data. The loader settings are tuned by measurement in the tuner: ``torchturbo.tune.tune_loader``.
"""

from torchturbo.data.augment import BatchAugment
from torchturbo.data.bucketing import BucketBatchSampler, pack_batches, padding_fraction
from torchturbo.data.collate import pad_collate
from torchturbo.data.loader import build_loader, to_device
from torchturbo.data.memmap import MemmapDataset, write_memmap

__all__ = [
    "BatchAugment",
    "BucketBatchSampler",
    "MemmapDataset",
    "build_loader",
    "pack_batches",
    "pad_collate",
    "padding_fraction",
    "to_device",
    "write_memmap",
]
