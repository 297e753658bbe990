"""One process: a tiny Qwen3-MoE through the converter (HF -> dist checkpoint) has the weights and logits of
transformers' own, for both routing rules (norm_topk_prob true: the top-k weights renormalised, megatron's
softmax over the top-k logits; false: megatron's moe_router_pre_softmax). The same at EP 2 and under TP / PP:
tests/distributed/test_moe_parallel.py."""

import pytest

from tests.helpers.moe import save_tiny_moe


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "pre_softmax"])
def test_logits_equal_transformers(tmp_path, world_of_one, norm_topk_prob):
    from megatron_dapo.mcore.hf_to_mcore import hf_to_megatron
    from megatron_dapo.mcore.logit_check import verify

    hf = save_tiny_moe(tmp_path / "hf", norm_topk_prob=norm_topk_prob)
    hf_to_megatron(hf, tmp_path / "ckpt", make_vocab_size_divisible_by=64, progress=False)
    report = verify(hf, tmp_path / "ckpt")
    assert report.weights_ok, report.format()
    assert report.max_logit_diff <= 1e-5, report.format()
