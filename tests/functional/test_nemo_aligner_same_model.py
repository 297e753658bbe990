"""The same tiny Qwen2-shaped model, with the same weights, through our MegatronActor and through the
NeMo-Aligner adapter's DAPO actor on the real NeMo 2.1 / megatron-core 0.10 stack: one update's
loss and gradients on one batch must agree.

Our side runs here (tests/nemo_aligner/ours_side.py: megatron-core 0.19.2, our update path up to the
optimizer step); NeMo's runs in ``.venv-nemo`` under torchrun (probe_same_model.py), which copies
our weights in by an explicit name map and reports every name or shape that did not fit. The
reference is the other stack: a different megatron-core, NeMo's config translation, masks, attention
kernel, log-prob computation, micro-batching and gradient path. The DAPO surrogate itself is shared
(the adapter calls algo.compute_policy_loss), so this does not check the surrogate's formula:
probe_step.py and the loss's unit tests check that by hand.

Tolerances: measured on 2 CPU cores, fp32: loss relative difference 0 (the same float32), per-parameter
max relative gradient difference <= 8.5e-7 (the q/k/v bias of layer 0); the bounds leave about 10x.
"""

from __future__ import annotations

import pytest

from tests.helpers import nemo_venv
from tests.nemo_aligner import ours_side

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def run_nemo_side(ours_pt, out_json) -> dict:
    """probe_same_model.py in .venv-nemo, one process; its JSON, or a failure with its output's tail."""
    return nemo_venv.torchrun("probe_same_model.py", 1, out_json, str(ours_pt))


def assert_same(result: dict) -> None:
    """Every weight mapped and fitted, every gradient present, loss and gradients within bounds."""
    mapping = result["mapping"]
    assert not any(mapping[k] for k in ("ours_unmapped", "ours_missing", "nemo_missing", "nemo_not_loaded",
                                        "shape_mismatch")), f"weights did not map one to one: {mapping}"
    assert not result["no_grad"], f"no NeMo gradient for {result['no_grad']}"
    assert result["loss_rel"] < LOSS_RTOL, (
        f"loss: NeMo {result['loss']!r} vs ours {result['ours_loss']!r} (rel {result['loss_rel']:.3g})")
    over = {k: v for k, v in result["grad_max_rel"].items() if not v < GRAD_RTOL}
    assert not over, f"gradients differ beyond {GRAD_RTOL} (max |ours - NeMo| / max |ours|): {over}"


@pytest.mark.slow
def test_same_weights_same_loss_and_gradients_as_nemo_aligner(tmp_path, monkeypatch):
    nemo_venv.require_nemo()
    for key in nemo_venv.LAUNCH_VARS:  # our side starts a one-process world of its own (no rendezvous)
        monkeypatch.delenv(key, raising=False)
    ours = ours_side.run(str(tmp_path / "ours.pt"))
    # The batch must exercise what differs between the sides: clipping on both edges, several
    # micro-batches of different shapes here against NeMo's fixed-size ones.
    assert ours["metrics"]["actor/pg_clipfrac_low"] > 0 and ours["metrics"]["actor/pg_clipfrac_high"] > 0
    assert ours["metrics"]["actor/num_micro_batches"] > 1
    # ... and our production output-layer backward (the loss's gradient hint), not its fallback
    assert ours["metrics"]["actor/grad_shortcut_used"] == ours["metrics"]["actor/num_micro_batches"]

    result = run_nemo_side(tmp_path / "ours.pt", tmp_path / "nemo.json")
    assert result["micro_batches"] == 4  # 8 rows in micro-batches of 2, counted as the schedule ran them
    assert_same(result)
    assert result["metrics"] == pytest.approx({k: ours["metrics"][k] for k in result["metrics"]}, abs=1e-6)
