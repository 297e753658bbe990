"""The local spec's SDPA core attention against megatron's own DotProductAttention (the module it
replaces): the same outputs and input gradients for GQA, causal, with and without an explicit mask;
unsupported settings refused by name."""

import copy

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.mcore import destroy_parallel, initialize_parallel, transformer_config_from_hf
from megatron_dapo.mcore.model import layer_spec
from megatron_dapo.mcore.sdpa_attention import SDPAttention
from tests.helpers.policy import tiny_hf_config


@pytest.fixture
def config(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    hf = tiny_hf_config()
    initialize_parallel(hf, parallel=ParallelConfig(), model=ModelConfig(), seed=0)
    yield transformer_config_from_hf(hf, model=ModelConfig(), parallel=ParallelConfig())
    destroy_parallel()


def _qkv(config, sq=11, b=3):
    g = torch.Generator().manual_seed(0)
    d, heads, groups = config.kv_channels, config.num_attention_heads, config.num_query_groups
    assert groups < heads  # GQA: the KV heads are shared
    shapes = [(sq, b, heads, d), (sq, b, groups, d), (sq, b, groups, d)]
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _run(module, qkv, mask=None):
    out = module(*qkv, mask, attn_mask_type=AttnMaskType.causal)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad.clone() for t in qkv]
    for t in qkv:
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("explicit_mask", [False, True])
def test_matches_megatron_dot_product_attention(config, explicit_mask):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, ref = SDPAttention(config, **kwargs), DotProductAttention(config, **kwargs)
    qkv = _qkv(config)
    sq = qkv[0].shape[0]
    # megatron's convention: True = masked out; a causal mask plus one padded key column
    mask = None
    if explicit_mask:
        mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1)[None, None].repeat(3, 1, 1, 1)
        mask[1, :, :, 4] = True
        mask[1, :, 4, 4] = False  # every query keeps at least one key
    out, grads = _run(ours, qkv, mask)
    ref_out, ref_grads = _run(ref, qkv, mask)
    assert out.shape == ref_out.shape == (sq, 3, config.num_attention_heads * config.kv_channels)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-6)
    # the comparison can fail: without causality the outputs differ
    full = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.no_mask, attention_type="self")
    assert (full(*qkv, None, attn_mask_type=AttnMaskType.no_mask).detach() - ref_out).abs().max() > 0.1


def test_local_spec_uses_it(config):
    assert layer_spec(config).submodules.self_attention.submodules.core_attention is SDPAttention


@pytest.mark.parametrize("change, name", [(dict(attention_dropout=0.1), "attention_dropout"),
                                          (dict(window_size=(8, 0)), "window_size"),
                                          (dict(softmax_type="off-by-one"), "softmax_type")])
def test_refuses_what_it_does_not_compute(config, change, name):
    bad = copy.copy(config)  # not dataclasses.replace: __post_init__ would reject some values first
    for key, value in change.items():
        setattr(bad, key, value)
    with pytest.raises(ValueError, match=name):
        SDPAttention(bad, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
