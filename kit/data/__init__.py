"""Datasets and the data pipeline: order, filter, chunk, batch, pad → :class:`kit.Batch`.

>>> import kit.data
>>> ds = kit.data.Task12AXDataset(num_seqs=200, seq_ordering="laplace:.20")
>>> for batch in kit.data.batches(ds, batch_size=2000, max_seqs=32, extern_data=ds.extern_data):
...     x = batch["data"].tensor  # [B, T, 9], zero-padded; batch["data"].lengths
"""

from __future__ import annotations

from kit.data.batch import Batch, Field, StringField
from kit.data.dataset import (
    ArrayDataset,
    Dataset,
    DatasetProtocol,
    GeneratorDataset,
    TorchDataset,
    from_torch_dataset,
)
from kit.data.distrib_files import DistributeFilesDataset
from kit.data.extern_data import DataSpec, ExternData
from kit.data.hdf import HDFDataset
from kit.data.hdf_write import write_hdf
from kit.data.make import make_dataset
from kit.data.meta import ConcatDataset, MetaDataset, StaticDataset
from kit.data.options import PipelineOptions
from kit.data.ordering import seq_order
from kit.data.pipeline import Pipeline, batches
from kit.data.returnn_adapter import ReturnnDataset
from kit.data.text import CharTextDataset
from kit.data.toy import Task12AXDataset

__all__ = [
    "ArrayDataset",
    "Batch",
    "CharTextDataset",
    "ConcatDataset",
    "DataSpec",
    "Dataset",
    "DatasetProtocol",
    "DistributeFilesDataset",
    "ExternData",
    "Field",
    "StringField",
    "GeneratorDataset",
    "HDFDataset",
    "MetaDataset",
    "Pipeline",
    "PipelineOptions",
    "ReturnnDataset",
    "StaticDataset",
    "Task12AXDataset",
    "TorchDataset",
    "batches",
    "from_torch_dataset",
    "make_dataset",
    "seq_order",
    "write_hdf",
]
