"""mcore/dcp_overlapped_write.py: a torch_dist file written with each item serialized in a thread
while the previous one is written. The reference is torch DCP's own ``_write_item``, one item after
another into the same kind of file: the bytes and the ``WriteResult``s must be the same."""

import io

import pytest
import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorProperties, TensorWriteData, WriteItem, WriteItemType

from megatron_dapo.mcore.dcp_overlapped_write import largest_tensor_bytes, write_items

PREFIX = b"x" * 13  # the stream need not start at 0: offsets are its tell()


def _items() -> tuple[list[WriteItem], dict[str, object]]:
    """A byte item, then tensors: dtypes, a scalar, one under the size kept uncopied, one larger
    than the in-flight cap the tests give, and a chunk of a larger tensor (the largest tensor, but
    not the largest chunk)."""
    torch.manual_seed(0)
    payload = io.BytesIO()
    torch.save({"step": 3}, payload)
    data: dict[str, object] = {"common": payload}
    items = [WriteItem(index=MetadataIndex("common"), type=WriteItemType.BYTE_IO)]
    tensors = {"bf16": torch.randn(300, 200).to(torch.bfloat16), "small": torch.arange(10, dtype=torch.int64),
               "scalar": torch.tensor(2.5), "big": torch.randn(512, 1024), "fp32": torch.randn(64, 300),
               "shard": torch.randn(40, 700).to(torch.bfloat16)}
    for name, tensor in tensors.items():
        offsets, size = ((80, 0), torch.Size([4000, 700])) if name == "shard" else ((0,) * tensor.dim(), tensor.shape)
        items.append(WriteItem(index=MetadataIndex(name, offsets), type=WriteItemType.TENSOR,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, tensor.shape),
                                                           properties=TensorProperties(dtype=tensor.dtype),
                                                           size=size)))
        data[name] = tensor
    return items, data


def _resolve(data):
    def resolve(item):
        value = data[item.index.fqn]
        if isinstance(value, io.BytesIO):
            value.seek(0)
        return value
    return resolve


def _torch_file(items, data) -> tuple[bytes, list]:
    stream = io.BytesIO()
    stream.write(PREFIX)
    results = [_write_item(_StorageWriterTransforms(), stream, _resolve(data)(item), item, "__0_0.distcp",
                           SerializationFormat.TORCH_SAVE) for item in items]
    return stream.getvalue(), results


@pytest.mark.parametrize("cap", [1, 600_000, 10**9])  # no overlap, some, all items ahead
def test_bytes_and_write_results_are_torchs(cap):
    items, data = _items()
    expected, expected_results = _torch_file(items, data)
    stream = io.BytesIO()
    stream.write(PREFIX)
    written = []
    results = write_items(stream, items, _resolve(data), "__0_0.distcp", _StorageWriterTransforms(),
                          max_in_flight=cap, wrote=written.append)
    assert stream.getvalue() == expected
    assert results == expected_results
    assert written == [r.storage_data.length for r in results]


def test_in_flight_bytes_stay_under_the_cap_but_for_an_item_alone():
    items, data = _items()
    cap = 1_300_000  # between "bf16" + "small" and "big" (2 MB): "big" waits until nothing is in flight
    sizes = {i.index.fqn: 0 if i.type == WriteItemType.BYTE_IO else data[i.index.fqn].nbytes for i in items}
    assert largest_tensor_bytes(items) == sizes["big"] > cap
    state = {"in_flight": 0, "peak": 0, "alone": []}

    def resolve(item):
        size = sizes[item.index.fqn]
        if state["in_flight"] and state["in_flight"] + size > cap:
            raise AssertionError(f"{item.index.fqn} resolved with {state['in_flight']} bytes in flight")
        state["alone"] += [item.index.fqn] if size > cap else []
        state["in_flight"] += size
        return _resolve(data)(item)

    written = iter(items)

    def wrote(_length):
        state["in_flight"] -= sizes[next(written).index.fqn]

    write_items(io.BytesIO(), items, resolve, "f", _StorageWriterTransforms(), max_in_flight=cap, wrote=wrote)
    assert state["alone"] == ["big"] and state["in_flight"] == 0


def test_an_error_resolving_an_item_reaches_the_caller_and_stops_the_thread():
    items, data = _items()

    def resolve(item):
        if item.index.fqn == "fp32":
            raise ValueError("no such tensor")
        return _resolve(data)(item)

    with pytest.raises(ValueError, match="no such tensor"):
        write_items(io.BytesIO(), items, resolve, "f", _StorageWriterTransforms(), max_in_flight=10**9)
