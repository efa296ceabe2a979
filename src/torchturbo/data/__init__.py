"""Input pipeline: loader building, device-side augmentation, length bucketing, sequence packing
and its document masks, memory-mapped data. The loader settings are tuned by measurement in the
tuner: ``torchturbo.tune.tune_loader``.
"""

from torchturbo.base.device import to_device
from torchturbo.data.augment import BatchAugment
from torchturbo.data.bucketing import BucketBatchSampler, pack_batches, padding_fraction
from torchturbo.data.collate import pad_collate
from torchturbo.data.document_mask import document_mask, flex_document_mask
from torchturbo.data.loader import build_loader
from torchturbo.data.memmap import MemmapDataset, write_memmap
from torchturbo.data.packing import PackingBatchSampler, pack_documents, packed_collate

__all__ = [
    "BatchAugment",
    "BucketBatchSampler",
    "MemmapDataset",
    "PackingBatchSampler",
    "build_loader",
    "document_mask",
    "flex_document_mask",
    "pack_batches",
    "pack_documents",
    "packed_collate",
    "pad_collate",
    "padding_fraction",
    "to_device",
    "write_memmap",
]
