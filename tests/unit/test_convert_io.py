"""Streaming safetensors I/O: sharded reads, bounded shard writes that transformers can load."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.convert import (
    ConversionError, SafetensorsReader, ShardedSafetensorsWriter, copy_side_files,
)
from megatron_dapo.convert.synthetic import write_random_hf_checkpoint

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


@pytest.fixture
def hf_dir(tmp_path):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    return tmp_path / "hf", {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reader_reads_sharded_checkpoint_one_tensor_at_a_time(hf_dir):
    path, sd = hf_dir
    assert (path / "model.safetensors.index.json").is_file()
    with SafetensorsReader(path, max_open_files=1) as r:
        assert set(r.names()) == set(sd)
        for name in r.names():
            assert r.shape(name) == tuple(sd[name].shape)
            assert torch.equal(r.get(name), sd[name])
        assert r.get("model.norm.weight", torch.bfloat16).dtype == torch.bfloat16
        with pytest.raises(ConversionError, match="no tensor 'nope'"):
            r.get("nope")


def test_writer_shards_bound_size_and_from_pretrained_loads(hf_dir, tmp_path):
    path, sd = hf_dir
    out = tmp_path / "out"
    w = ShardedSafetensorsWriter(out, max_shard_bytes=30_000)
    with SafetensorsReader(path) as r:
        for name in r.names():
            w.add(name, r.get(name))
    files = w.close()
    # A shard exceeds the limit by at most one tensor (the largest is 12,800 bytes) plus its header.
    assert len(files) > 1 and all(f.stat().st_size < 30_000 + 12_800 + 4096 for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd) and index["metadata"]["total_size"] == w.total_bytes
    assert "config.json" in copy_side_files(path, out)
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_writer_single_shard_and_views_of_one_storage(tmp_path):
    fused = torch.arange(12.0).reshape(6, 2)
    q, k, v = torch.split(fused, [2, 2, 2])  # views sharing one storage, as after a QKV split
    w = ShardedSafetensorsWriter(tmp_path)
    for name, t in zip("qkv", (q, k, v)):
        w.add(name, t)
    assert [f.name for f in w.close()] == ["model.safetensors"]
    with SafetensorsReader(tmp_path) as r:
        assert torch.equal(r.get("v"), v)
    with pytest.raises(ConversionError, match="written twice"):
        w.add("q", q)
        w.add("q", q)


def test_synthetic_checkpoint_has_the_configured_shapes(tmp_path):
    config = {**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "tie_word_embeddings": True}
    write_random_hf_checkpoint(config, tmp_path, dtype=torch.float32, max_shard_bytes=20_000)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    with SafetensorsReader(tmp_path) as r:
        assert torch.equal(model.model.embed_tokens.weight, r.get("model.embed_tokens.weight"))
        assert "lm_head.weight" not in r.names()


def test_pack_consecutive_groups_in_order_by_bytes_and_key():
    """The converter's one packing rule (shards, export buckets, megatron_to_hf's regions), on
    hand-worked cases: a group closes before the item that would pass the limit, an oversized item
    is a group alone, ``same`` splits on a change of key, nothing in, nothing out."""
    from megatron_dapo.convert.packing import pack_consecutive

    size = lambda x: x[1]
    items = [("a", 4), ("b", 4), ("c", 3), ("d", 12), ("e", 1), ("f", 10)]
    assert [[n for n, _ in g] for g in pack_consecutive(items, size, 10)] == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    assert [[n for n, _ in g] for g in pack_consecutive(items, size, 11)] == [["a", "b", "c"], ["d"], ["e", "f"]]
    keyed = [("x", 1), ("x", 1), ("y", 1), ("x", 1)]
    assert pack_consecutive(keyed, size, 100, same=lambda a, b: a[0] == b[0]) == [keyed[:2], [keyed[2]], [keyed[3]]]
    assert pack_consecutive([], size, 10) == []


@pytest.mark.parametrize("parts", [2, 3])
def test_parts_written_side_by_side_are_the_one_writers_files(tmp_path, parts):
    """StreamingSafetensorsWriter in ``parts`` parts (as the conversion's worker processes write
    them, here one after another, each adding only the tensors it wants) against one writer: the
    same files, byte for byte; the shard names and the index also ShardedSafetensorsWriter's (whose
    files order a shard's tensors by safetensors' own rule)."""
    from megatron_dapo.convert.safetensors_io import StreamingSafetensorsWriter

    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(int(n), 8, generator=gen).to(dtype)
               for i, (n, dtype) in enumerate(zip(torch.randint(1, 40, (11,), generator=gen),
                                                  [torch.bfloat16, torch.float32] * 6))}
    layout = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    reference = ShardedSafetensorsWriter(tmp_path / "reference", max_shard_bytes=600)
    one = StreamingSafetensorsWriter(tmp_path / "one", layout, max_shard_bytes=600)
    for name, t in tensors.items():
        reference.add(name, t)
        one.add(name, t)
    reference.close()
    one.close()
    writers = [StreamingSafetensorsWriter(tmp_path / "parts", layout, max_shard_bytes=600, part=k, parts=parts)
               for k in range(parts)]
    for writer in writers:
        for name, t in tensors.items():
            if writer.wants(name):
                writer.add(name, t)
        assert writer.close() == []
    assert sum(map(bool, (w._order for w in writers))) == parts  # every part wrote something
    writers[0].name_parts()
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(files) > parts and files == sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "reference").iterdir())
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "parts" / name).read_bytes(), name
    index = "model.safetensors.index.json"
    assert (tmp_path / "parts" / index).read_text() == (tmp_path / "reference" / index).read_text()


@pytest.mark.parametrize("max_shard_bytes", [10**9, 40, 1])
@pytest.mark.parametrize("as_save_file", [False, True])
def test_streaming_writer_gives_the_sharded_writers_bytes(tmp_path, max_shard_bytes, as_save_file):
    """StreamingSafetensorsWriter, told the layout up front, writes ShardedSafetensorsWriter's shards,
    names and index; with ``as_save_file`` byte for byte (save_file's order: the widest dtype first,
    then by name, each tensor written to its place as it arrives), else in the order added."""
    from megatron_dapo.convert.safetensors_io import StreamingSafetensorsWriter

    g = torch.Generator().manual_seed(0)
    tensors = [(name, torch.randn(shape, generator=g).to(dtype)) for name, shape, dtype in [
        ("z.weight", (3, 4), torch.bfloat16), ("a.norm", (4,), torch.float32), ("B.weight", (2, 2), torch.bfloat16),
        ("c.x", (5,), torch.float16), ("m", (7,), torch.float32), ("e", (0,), torch.bfloat16)]]
    sharded, streamed = tmp_path / "sharded", tmp_path / "streamed"
    writer = ShardedSafetensorsWriter(sharded, max_shard_bytes=max_shard_bytes)
    for name, t in tensors:
        writer.add(name, t)
    writer.close()
    writer = StreamingSafetensorsWriter(streamed, [(n, tuple(t.shape), t.dtype) for n, t in tensors],
                                        max_shard_bytes=max_shard_bytes, as_save_file=as_save_file)
    for name, t in tensors:
        writer.add(name, t)
    writer.close()
    files = sorted(p.name for p in sharded.iterdir())
    assert files == sorted(p.name for p in streamed.iterdir())
    same = [(sharded / f).read_bytes() == (streamed / f).read_bytes() for f in files]
    if as_save_file or max_shard_bytes == 1:  # one tensor a shard: any order is save_file's
        assert all(same)
    else:
        assert not all(same)  # the order added is not save_file's
    with SafetensorsReader(streamed) as reader:  # the same tensors either way
        assert sorted(reader.names()) == sorted(n for n, _ in tensors)
        assert all(torch.equal(reader.get(n), t) for n, t in tensors)
