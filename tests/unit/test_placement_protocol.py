"""One placement interface: both placements carry every member of ``rollout.placements.Placement``
with its parameters, and the colocated one answers the asked-for-ahead calls as the separate one
does (a submitted batch is collected once, as ``generate`` returns it; cancelled, it is forgotten).
The separate placement's calls against real engine ranks are tests/functional/test_separate_placement.py."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.placement import RolloutPlacement
from megatron_dapo.rollout.placements import Placement
from megatron_dapo.rollout.separate import RemoteEngines, SeparatePlacement
from tests.helpers.rollout import tiny_qwen2

METHODS = sorted(name for name, member in vars(Placement).items()
                 if inspect.isfunction(member) and not name.startswith("_"))
ATTRIBUTES = sorted(Placement.__annotations__)


def _signature(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def colocated():
    torch.manual_seed(0)
    return RolloutPlacement(HFEngine(tiny_qwen2(0), eos_token_ids=(), max_batch_size=16), alone=True)


@pytest.fixture
def separate():
    # what SeparatePlacement reads of its world split before the engines start (no links yet)
    split = SimpleNamespace(side_rank=0, num_trainers=1, wait_s=60.0, num_engines=1, links=None, trainers=None,
                            cuts=None)
    return SeparatePlacement(RemoteEngines(split))


def test_the_protocol_names_what_the_loop_uses():
    assert set(METHODS) >= {"generate", "submit", "collect", "wait_for", "cancel", "from_leader", "gather",
                            "gather_all", "sync", "take_waits", "sleep", "wake_up", "shutdown", "abort", "clear_abort",
                            "report_progress"}
    assert ATTRIBUTES == ["aborts", "is_leader", "num_replicas", "rank", "replica", "world_size"]


@pytest.mark.parametrize("name", METHODS)
def test_both_placements_take_each_call_as_the_protocol_says(name):
    want = _signature(getattr(Placement, name))
    for cls in (RolloutPlacement, SeparatePlacement):
        assert _signature(getattr(cls, name)) == want, f"{cls.__name__}.{name}"


def test_both_placements_are_placements(colocated, separate):
    for placement in (colocated, separate):
        assert isinstance(placement, Placement)
        assert all(isinstance(getattr(placement, a), bool if a in ("is_leader", "aborts") else int)
                   for a in ATTRIBUTES)
    assert separate.from_leader([[1, 2]]) == [[1, 2]]  # only the leader sends: as given
    assert colocated.from_leader([[1, 2]]) == [[1, 2]]  # one replica of one rank: its own


def test_colocated_submit_is_generate_now_collected_once(colocated):
    torch.set_num_threads(1)
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=7)
    prompts = [[1, 2, 3], [4, 5]]
    direct = colocated.generate(prompts, 2, params)
    first, second = colocated.submit(prompts, 2, params), colocated.submit(prompts[:1], 2, params)
    assert first != second and colocated.wait_for([first, second]) == 2
    positions, rollouts = colocated.collect(first)
    assert positions == direct[0]
    assert [[r.response_ids for r in g] for g in rollouts] == [[r.response_ids for r in g] for g in direct[1]]
    with pytest.raises(KeyError):
        colocated.collect(first)  # collected once
    colocated.cancel([second])
    with pytest.raises(KeyError):
        colocated.collect(second)  # forgotten


def test_an_abort_ends_the_colocated_generation_until_cleared_and_both_placements_abort(colocated, separate):
    """A stop's cut (train.Loop.cut_short): the colocated placement's next generate raises, also when
    the abort came after the engine's batch ended (every rank must leave together), and runs again
    once cleared; the separate placement aborts too (its wait for a batch: test_separate_waits.py)."""
    from megatron_dapo.rollout.engine import GenerationAborted

    params = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    want = colocated.generate([[5, 6]], 2, params)
    assert colocated.aborts and colocated.abort()
    with pytest.raises(GenerationAborted, match="a stop cut the step short"):
        colocated.generate([[5, 6]], 2, params)
    colocated.clear_abort()
    assert colocated.generate([[5, 6]], 2, params)[1][0][0].response_ids == want[1][0][0].response_ids
    assert separate.aborts and separate.abort()
