"""actor.offload_during_rollout (mcore/offload.py): the trainer's state off the device and back, in one
process (gloo world of one), real megatron-core on CPU.

On CPU the "device" is host memory too, but the mechanism is the one a GPU runs: each storage's bytes
are copied into other (host) storages, the storage itself is resized to 0 bytes, and on the way back
re-allocated and filled in place. So the checks here are real: while offloaded the DDP buffers, the
Adam moments, the fp32 main params (and the weights) hold no memory at all, and after the onload the
same tensor objects hold the same bytes. The reference for "training is unchanged" is the same run
without offloading, compared bit for bit (torch.equal) after 3 steps of offload -> onload -> old
log-probs -> 2 updates, with and without the distributed optimizer, fp32 and bf16 (fp32 main params),
weights offloaded or not. The GPU side (device memory really drops) is tests/gpu/test_offload_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_dapo.config import ActorConfig, ModelConfig
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

STEPS, UPDATES = 3, 2  # rollout steps, updates per step (tiny_cfg: 8 samples, mini-batches of 4)


@pytest.fixture
def one_process(monkeypatch):
    """MegatronActor starts a one-process gloo world itself (no RANK); torn down after the test."""
    from megatron_dapo.mcore import destroy_parallel

    monkeypatch.delenv("RANK", raising=False)
    yield
    destroy_parallel()


def _actor(*, dist_opt: bool, dtype: str, offload: bool = False, weights: bool = False):
    from megatron_dapo.mcore.actor import MegatronActor

    cfg = tiny_cfg(dist_opt=dist_opt)
    cfg = dataclasses.replace(cfg, model=ModelConfig(make_vocab_size_divisible_by=64, dtype=dtype),
                              actor=ActorConfig(offload_during_rollout=offload, offload_weights=weights))
    return MegatronActor(cfg, tiny_hf_config())


def _torch_optimizers(actor):
    return [o.optimizer for o in actor.optimizer.chained_optimizers]


def _snapshot(actor) -> dict[str, torch.Tensor]:
    """Copies of everything training carries from update to update: the weights, the torch optimizer's
    params (fp32 main params in bf16) and its state (exp_avg, exp_avg_sq, step)."""
    out = {f"w:{n}": p.detach().clone() for n, p in actor.model[0].named_parameters()}
    for i, opt in enumerate(_torch_optimizers(actor)):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"main:{i}.{g}.{j}"] = p.detach().clone()
                for k, v in opt.state.get(p, {}).items():
                    out[f"state:{i}.{g}.{j}.{k}"] = v.detach().clone()
    return out


def _train(actor, *, offload: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """STEPS steps as train.py runs them: (offload, onload), old log-probs, UPDATES updates."""
    metrics = []
    for step in range(STEPS):
        if offload:
            sizes = _sizes(actor.offloader)
            assert actor.offload_for_rollout()["actor/offloaded_gb"] > 0
            _scribble(sizes)
            actor.onload_after_rollout()
        xs = with_actor_log_probs(actor, make_samples(step), seed=100 + step)
        size = len(xs) // UPDATES
        metrics += [actor.get_loss_and_metrics(xs[i:i + size]) for i in range(0, len(xs), size)]
    return _snapshot(actor), metrics


def _sizes(offloader) -> list[int]:
    return [st.nbytes() for storages in offloader.storages().values() for st in storages]


def _scribble(sizes: list[int]) -> None:
    """While offloaded someone else uses the memory (the engine, on a GPU): blocks of the released sizes,
    filled with 0xff bytes (NaN as floats) and freed again, so that the onload's re-allocations most likely
    get them back dirty. Without this, CPU malloc often hands back the very block just released with its
    old bytes, and a storage the onload forgot to fill would still look right."""
    junk = [torch.full((n,), 255, dtype=torch.uint8) for n in sizes]
    junk.clear()


_REFERENCE: dict[tuple, tuple] = {}  # (dist_opt, dtype) -> (initial snapshot, final snapshot, metrics)


def _reference(dist_opt: bool, dtype: str):
    """The same run without offloading, in a world of its own (built with the same seed)."""
    from megatron_dapo.mcore import destroy_parallel

    key = (dist_opt, dtype)
    if key not in _REFERENCE:
        destroy_parallel()
        actor = _actor(dist_opt=dist_opt, dtype=dtype)
        start = _snapshot(actor)
        _REFERENCE[key] = (start, *_train(actor, offload=False))
        destroy_parallel()
    return _REFERENCE[key]


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:4]}"


# bf16 with the distributed optimizer is the GPU recipes' layout; bf16 without it (megatron's
# Float16OptimizerWithFloat16Params) is covered by the byte-for-byte round trip below.
LAYOUTS = [(False, "fp32"), (True, "fp32"), (True, "bf16")]


@pytest.mark.parametrize("weights", [False, True], ids=["state", "state+weights"])
@pytest.mark.parametrize("dist_opt,dtype", LAYOUTS, ids=["ddp-fp32", "dist-opt-fp32", "dist-opt-bf16"])
def test_training_with_offload_equals_training_without_bitwise(one_process, dist_opt, weights, dtype):
    start, want, want_metrics = _reference(dist_opt, dtype)
    actor = _actor(dist_opt=dist_opt, dtype=dtype, offload=True, weights=weights)
    _assert_bitwise(_snapshot(actor), start, "initial state")  # the same seed builds the same model
    got, metrics = _train(actor, offload=True)
    what = f"after {STEPS} steps with offload (dist_opt={dist_opt}, weights={weights}, {dtype})"
    assert any(k.startswith("state:") for k in got)  # Adam's state exists and was compared
    _assert_bitwise(got, want, what)
    assert metrics == want_metrics, what


def _grad_buffers(actor):
    return [b.grad_data for chunk in actor.model for b in chunk.buffers]


def _adam(actor):
    return [v for opt in _torch_optimizers(actor) for st in opt.state.values()
            for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]


def _main_params(actor):
    return [p for opt in _torch_optimizers(actor) for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp", "dist-opt"])
def test_the_move_is_real_and_the_same_tensors_come_back(one_process, dist_opt, dtype):
    """After an update: offloaded, every grad buffer, Adam moment, separate main param and weight holds
    0 bytes; a forward refuses; the bytes reported are those tensors' sizes. Back: the same objects,
    the same bytes. A 4 KiB slab makes most storages cross slab boundaries; keep_grads copies the
    gradients too, so every byte can be compared."""
    from megatron_dapo.mcore.offload import OffloadStats, StateOffloader

    actor = _actor(dist_opt=dist_opt, dtype=dtype)
    xs = with_actor_log_probs(actor, make_samples(0), seed=1)
    actor.get_loss_and_metrics(xs[:4])
    params = [p for p in actor.model[0].parameters()]
    grads, adam, mains = _grad_buffers(actor), _adam(actor), _main_params(actor)
    separate_mains = dtype == "bf16"  # fp32: the optimizer steps the weights (or views of param_data)
    weight_ids = {p.untyped_storage().data_ptr() for p in params}
    assert all((m.untyped_storage().data_ptr() in weight_ids) != separate_mains for m in mains)
    watched = grads + adam + mains + params
    before = [t.detach().clone() for t in watched]
    if dist_opt:  # the distributed optimizer's params are views of DDP's param buffer
        assert all(b.param_data is not None for b in actor.model[0].buffers)

    off = StateOffloader(actor.model, actor.optimizer, weights=True, keep_grads=True, slab_bytes=4096)
    sizes = _sizes(off)
    stats = off.offload()
    assert off.offloaded and all(t.untyped_storage().nbytes() == 0 for t in watched)
    assert stats.grad_bytes == sum(g.nbytes for g in grads)
    main_bytes = sum(m.nbytes for m in mains) if separate_mains else 0
    assert stats.optimizer_bytes == sum(t.nbytes for t in adam) + main_bytes
    if dist_opt:  # one param_data buffer holds every weight
        assert stats.weight_bytes == sum(b.param_data.nbytes for b in actor.model[0].buffers)
    else:
        assert stats.weight_bytes == sum(p.nbytes for p in params)
    assert stats.copied_bytes == stats.device_bytes and stats.num_storages > 20
    assert stats.host_bytes >= stats.device_bytes and stats.host_bytes % 4096 == 0
    assert off.offload() == OffloadStats()  # idempotent: nothing more to move
    with pytest.raises(RuntimeError, match="offloaded"):
        actor.get_inference_log_probs(xs[:1])
    _scribble(sizes)

    back = off.onload()
    assert back.device_bytes == stats.device_bytes and not off.offloaded
    now = grads + adam + mains + [p for p in actor.model[0].parameters()]
    assert all(a is b for a, b in zip(now, watched))  # the same objects...
    assert all(torch.equal(a, b) for a, b in zip(watched, before))  # ...holding the same values
    assert off.onload().num_storages == 0  # idempotent
    actor.get_loss_and_metrics(xs[4:])  # and training goes on


def test_before_the_first_update_only_what_exists_moves(one_process):
    """No Adam state before the first update: the fp32 main params (bf16) and the gradient buffers move,
    nothing else; the actor's default releases the gradients without copying them (zeros on the way
    back, what every update starts from)."""
    actor = _actor(dist_opt=True, dtype="bf16", offload=True)
    assert not _adam(actor)
    off = actor.offloader
    stats = off.offload()
    grads, mains = _grad_buffers(actor), _main_params(actor)
    assert stats.weight_bytes == 0
    assert all(p.untyped_storage().nbytes() > 0 for p in actor.model[0].parameters())
    assert stats.grad_bytes == sum(g.nbytes for g in grads) and stats.copied_bytes == stats.optimizer_bytes
    assert stats.optimizer_bytes == sum(m.nbytes for m in mains)
    off.onload()
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_disabled_by_default_is_a_no_op(one_process):
    actor = _actor(dist_opt=True, dtype="fp32")
    assert actor.offloader is None and actor.offload_for_rollout() == {}
    actor.onload_after_rollout()  # nothing to do
