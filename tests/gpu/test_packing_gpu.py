"""Packed micro-batches through the Transformer Engine spec (skipped without CUDA and TE): megatron hands
TE's attention ``PackedSeqParams`` with ``qkv_format="thd"``; the packed log-probs, loss and grad norm
must equal the padded layout's on the same weights. ``train.pack_sequences`` stays refused with the TE
spec (mcore/parallel.check_packing) until this has passed on a GPU; the test sets the step's settings
directly, past that refusal. Not run yet (no GPU with TE lent; docs/packing.md)."""

import dataclasses
import importlib.util
import json

import pytest
import torch

from tests.helpers.convert import save_tiny_hf
from tests.helpers.policy import make_samples, tiny_cfg

pytestmark = pytest.mark.gpu
requires_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                 reason="Transformer Engine is not installed (it comes with the NGC container)")
LOGPROBS_ATOL, LOSS_RTOL = 2e-3, 1e-3  # fp32 TE: fused attention's summation order, padded vs THD kernels


@requires_te
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_thd_packing_equals_padding(tmp_path, world_of_one):
    from megatron_dapo.mcore.actor import MegatronActor

    hf_dir = save_tiny_hf(tmp_path / "hf")
    hf = json.loads((hf_dir / "config.json").read_text())
    cfg = tiny_cfg()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl="transformer_engine",
                                                              dtype="fp32"))
    got = {}
    for packed in (False, True):
        actor = MegatronActor(cfg, hf, initialize=not packed)
        actor.load_hf_weights(str(hf_dir))
        actor.settings = dataclasses.replace(actor.settings, pack_sequences=packed)
        xs = make_samples(0, vocab=hf["vocab_size"])
        lps = actor.get_inference_log_probs(xs)
        xs = [dataclasses.replace(x, old_log_probs=lp + 0.1) for x, lp in zip(xs, lps)]
        got[packed] = (lps, actor.get_loss_and_metrics(xs))
    (padded, m_padded), (packed, m_packed) = got[False], got[True]
    for i, (a, b) in enumerate(zip(padded, packed)):
        torch.testing.assert_close(b, a, rtol=0, atol=LOGPROBS_ATOL, msg=f"log-probs of sample {i}")
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=LOSS_RTOL), (key, m_padded[key], m_packed[key])
