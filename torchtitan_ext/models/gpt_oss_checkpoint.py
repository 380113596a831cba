"""Loading GPT-OSS's published Hugging Face checkpoints, whose experts are stored in MXFP4
(``checkpoint.initial_load_in_hf_quantized``).

torchtitan's GPT-OSS adapter reads them with torch's ``QuantizedHuggingFaceStorageReader``, which dequantizes each
``<name>_blocks`` tensor ([..., G, 16] bytes, 32 FP4 elements per group, a ``<name>_scales`` exponent each) into
[..., G * 32] values. In torch 2.13 that reader gives the tensor its dequantized size but leaves the chunk the file
stores as it is ([..., G, 16]); the load planner reads chunks, so it asks for the first G values of each row, and
the rest of the model's expert weights keep the values they had before the load, with no error. It also gives a
``_blocks`` tensor without ``_scales`` (stored unquantized, as torchtitan's own HF export names the expert weights)
a size it does not have, and the load stops on it. :class:`MXFP4Reader` states the chunks in dequantized elements
too, and reads a tensor without scales as stored; everything else is torch's reader.
"""

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from torchtitan.models.gpt_oss.model.state_dict_adapter import GptOssStateDictAdapter as TorchTitanAdapter

BLOCKS_SUFFIX = "_blocks"


def _dequantized(offsets: torch.Size, sizes: torch.Size) -> tuple[torch.Size, torch.Size]:
    """A stored chunk of a ``_blocks`` tensor ([..., groups, bytes]) in dequantized elements ([..., values])."""
    *lead_offsets, group_offset, _ = offsets
    *lead_sizes, groups, group_bytes = sizes
    values_per_group = 2 * group_bytes  # two FP4 elements a byte
    return (torch.Size([*lead_offsets, group_offset * values_per_group]),
            torch.Size([*lead_sizes, groups * values_per_group]))


class MXFP4Reader(QuantizedHuggingFaceStorageReader):
    """torch's reader of quantized HF checkpoints, with each MXFP4 tensor's stored chunks in dequantized elements and
    a ``_blocks`` tensor without scales at its stored size (the module docstring says why)."""

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()  # every _blocks tensor's size dequantized, its chunks not
        for fqn, tensor in metadata.state_dict_metadata.items():
            if not fqn.endswith(BLOCKS_SUFFIX) or not isinstance(tensor, TensorStorageMetadata):
                continue
            if fqn not in self._weight_scale_mapping:
                # no _scales: stored unquantized (torchtitan's HF export names GPT-OSS's expert weights _blocks too),
                # and read as stored; torch's reader resized it all the same
                ends = [[offset + size for offset, size in zip(chunk.offsets, chunk.sizes)] for chunk in tensor.chunks]
                tensor.size = torch.Size(max(column) for column in zip(*ends))
                continue
            chunks = []
            for chunk in tensor.chunks:
                stored = MetadataIndex(fqn, chunk.offsets)
                offsets, sizes = _dequantized(chunk.offsets, chunk.sizes)
                metadata.storage_data[MetadataIndex(fqn, offsets)] = metadata.storage_data.pop(stored)
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            tensor.chunks = chunks
        return metadata


class GptOssStateDictAdapter(TorchTitanAdapter):
    """torchtitan's GPT-OSS adapter, reading MXFP4 checkpoints with :class:`MXFP4Reader`."""

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:
            return MXFP4Reader(path=path, thread_count=4)  # torchtitan's thread count
        return super().get_hf_storage_reader(path, from_quantized)
