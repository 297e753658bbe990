"""mcore/dcp_in_place.py: a torch_dist checkpoint's tensor records read straight into their
destinations. The references are torch's own ``torch.save`` / ``torch.load`` (a record's layout) and
torch DCP's ``FileSystemReader`` (what a load gives); every record the in-place path declines goes
through the latter."""

import io

import pytest
import torch

from megatron_dapo.mcore.dcp_in_place import _reader_class, tensor_record


def _record(obj) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_a_plain_tensors_bytes_lie_where_the_record_says(dtype):
    tensor = (torch.randn(37, 5) * 100).to(dtype)
    prefix = b"x" * 13  # a record inside a larger file, as in a .distcp
    raw = prefix + _record(tensor).getvalue()
    file = io.BytesIO(raw)
    record = tensor_record(file, len(prefix), len(raw) - len(prefix))
    assert record is not None
    assert (record.dtype, record.size, record.stride, record.storage_offset) == (dtype, (37, 5), (5, 1), 0)
    start = len(prefix) + record.data_offset
    got = torch.frombuffer(bytearray(raw[start:start + tensor.nbytes]), dtype=dtype).view(37, 5)
    assert torch.equal(got, tensor)


def test_views_and_objects_are_described_or_declined():
    base = torch.arange(20, dtype=torch.float32)
    view = _record(base[4:10])  # torch.save keeps the whole storage: offset 4, 20 elements
    record = tensor_record(view, 0, len(view.getvalue()))
    assert (record.storage_offset, record.storage_numel, record.size) == (4, 20, (6,))
    transposed = _record(base.view(4, 5).t())
    assert tensor_record(transposed, 0, len(transposed.getvalue())).stride == (1, 5)
    for obj in ({"a": base}, [base], 3, "text"):
        data = _record(obj)
        assert tensor_record(data, 0, len(data.getvalue())) is None, obj
    assert tensor_record(io.BytesIO(b"not a zip at all"), 0, 16) is None


def test_a_megatron_checkpoint_loads_the_same_through_either_reader(tmp_path):
    """A torch DCP checkpoint of tensors, views, a transposed tensor and an object, loaded into fresh
    tensors through torch's reader and through the in-place one: equal, and the in-place path took the
    whole contiguous records (counted) and left the rest to torch."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(64), "empty": torch.zeros(0, 3),
             "t": torch.randn(16, 8).t(), "scalar": torch.tensor(3.5), "meta": {"step": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)

    def blank():
        return {k: (torch.full_like(v.contiguous(), -1) if isinstance(v, torch.Tensor) else {"step": 0})
                for k, v in state.items()}

    reader_class = _reader_class()
    taken = []
    real = reader_class._read_in_place

    def counted(self, file, request, planner):
        done = real(self, file, request, planner)
        taken.append((request.dest_index.fqn, done))
        return done

    reader_class._read_in_place = counted
    theirs, ours = blank(), blank()
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    dcp.load(ours, storage_reader=reader_class(str(tmp_path)), no_dist=True)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value) and torch.equal(theirs[key], value), key
    assert ours["meta"] == theirs["meta"] == {"step": 7}
    done = dict(taken)
    assert done["w"] and done["b"] and done["scalar"], done  # (DCP reads nothing for an empty tensor)
    assert not done["t"], done  # saved with its strides: torch's reader lays it out


def test_readers_sharing_a_cache_read_the_metadata_once(tmp_path):
    """The converter's loads of one checkpoint share its .metadata: after the first reader read it,
    a second reads nothing (here: the file is gone) and still loads the tensors."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    reader_class, cache = _reader_class(), {}
    first = reader_class(str(tmp_path))
    first.metadata_cache = cache
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=first, no_dist=True)
    (tmp_path / ".metadata").unlink()
    second = reader_class(str(tmp_path))
    second.metadata_cache = cache
    again = {"w": torch.zeros(6)}
    dcp.load(again, storage_reader=second, no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(6.0)) and torch.equal(again["w"], torch.arange(6.0))
    alone = reader_class(str(tmp_path))  # no cache: reads the (now missing) file
    with pytest.raises(dcp.api.CheckpointException) as failed:
        dcp.load({"w": torch.zeros(6)}, storage_reader=alone, no_dist=True)
    assert "No such file" in str(failed.value.failures)
