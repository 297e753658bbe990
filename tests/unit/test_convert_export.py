"""Streaming export / load logic on a stand-in module tree with Megatron's parameter names (no megatron).

The real GPTModel at TP/PP > 1 is covered in tests/distributed/test_convert_parallel.py; here the
stand-in checks layer renumbering, tied embeddings, buckets and error messages in one process.
"""

import pytest
import torch
from torch import nn

from megatron_dapo.convert import ConversionError, conversion_table, hf_to_megatron_state_dict, split_tp
from megatron_dapo.convert.export import export_hf_weights, load_hf_weights
from tests.helpers.convert import hf_state_dict, stand_in_chunk


class Reader:
    """SafetensorsReader's interface over an in-memory dict."""

    def __init__(self, sd):
        self.sd = sd

    def names(self):
        return list(self.sd)

    def shape(self, name):
        return tuple(self.sd[name].shape)

    def get(self, name, dtype=None):
        return self.sd[name].to(dtype)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bucket_bytes", [1, 10**9])
def test_export_from_two_virtual_chunks_equals_hf(tied, bucket_bytes):
    config, sd = hf_state_dict(tie_word_embeddings=tied)
    table = conversion_table(config, padded_vocab_size=112)
    mc = hf_to_megatron_state_dict(table, sd)
    first = {k: v for k, v in mc.items() if not k.startswith(("decoder.final", "output"))}
    last = {k: v for k, v in mc.items() if not k.startswith("embedding")}
    chunks = [stand_in_chunk(first, range(0, 1)), stand_in_chunk(last, range(1, 2))]
    if tied:  # the last stage of a tied model holds a copy of the embedding as its output layer
        chunks[1].output_layer = nn.Linear(32, 112, bias=False)
    assert [n for n, _ in chunks[1].named_parameters()][0].startswith("decoder.layers.0.")  # local index
    out = dict(export_hf_weights(chunks, table, bucket_bytes=bucket_bytes))
    assert list(out) == table.hf_names()
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_load_then_export_is_identity_and_keeps_the_tp_shard():
    config, sd = hf_state_dict()
    table = conversion_table(config)
    shard1 = split_tp(table, hf_to_megatron_state_dict(table, sd), 2)[1]
    chunk = stand_in_chunk({k: torch.zeros_like(v) for k, v in shard1.items()}, range(0, 2))
    # tp_group=None means TP=1 here; emulate rank 1 of TP=2 by loading rank 1's split by hand.
    with pytest.raises(ConversionError, match="converted TP shard has shape"):
        load_hf_weights([chunk], table, Reader(sd))
    zeros = {k: torch.zeros_like(v) for k, v in hf_to_megatron_state_dict(table, sd).items()}
    full = stand_in_chunk(zeros, range(0, 2))
    assert load_hf_weights([full], table, Reader(sd)) == len(table.tasks)
    out = dict(export_hf_weights([full], table))
    assert list(out) == table.hf_names()  # every tensor comes back: all() over nothing would pass
    assert all(torch.equal(t, sd[n]) for n, t in out.items())


def test_export_names_a_missing_parameter():
    config, sd = hf_state_dict()
    table = conversion_table(config)
    mc = hf_to_megatron_state_dict(table, sd)
    del mc["decoder.layers.1.mlp.linear_fc2.weight"]
    expected = r"lacks Megatron parameters \['decoder.layers.1.mlp.linear_fc2.weight'\]"
    with pytest.raises(ConversionError, match=expected):
        list(export_hf_weights([stand_in_chunk(mc, range(0, 2))], table))
