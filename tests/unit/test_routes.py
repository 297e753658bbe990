"""rollout/routes.py: an MoE rollout's routes in one byte an expert (two past 256 experts), unchanged
through a checkpoint's JSON, a process boundary (pickle) and a partial response's continuation; a
checkpoint written with the routes as flat int lists still resumes."""

import json
import pickle

import numpy as np
import pytest
import torch

from megatron_dapo.groups import Group, routes_of
from megatron_dapo.rollout.engine import Rollout
from megatron_dapo.rollout.partial import extend
from megatron_dapo.rollout.routes import Routes


def _rollout(experts=None, prompt=(1, 2, 3), response=(4, 5)):
    fed = len(prompt) + len(response) - 1
    g = torch.Generator().manual_seed(0)
    routes = torch.randint(0, experts or 128, (fed, 6), generator=g)
    return Rollout(prompt_ids=list(prompt), response_ids=list(response), finish_reason="length",
                   routed_experts=Routes.of(routes, fed)), routes


def test_one_byte_an_expert_up_to_256_then_two():
    small, routes = _rollout(128)
    assert small.routed_experts.experts.dtype == np.uint8 and small.routed_experts.experts.nbytes == 4 * 6
    assert torch.equal(routes_of(small), routes.to(torch.int16))  # what the trainer's Sample holds
    big, routes = _rollout(384)
    assert big.routed_experts.experts.dtype == np.uint16 and torch.equal(routes_of(big), routes.to(torch.int16))
    with pytest.raises(ValueError, match="7 routed experts for 4 tokens"):
        Routes.of(np.zeros(7, dtype=np.int64), 4)
    with pytest.raises(ValueError, match="routes for 3 tokens, not the 4 fed to the engine"):
        Rollout(prompt_ids=[1, 2, 3], response_ids=[4, 5], routed_experts=Routes.of(np.zeros((3, 6)), 3))


def test_routes_survive_json_pickle_and_a_continued_response():
    rollout, _ = _rollout(300)
    group = Group(prompt_index=3, rollouts=[rollout], acc=[True], scores=[1.0], rewards=[1.0])
    back = Group.from_json(json.loads(json.dumps(group.to_json())))
    assert back == group and back.rollouts[0].routed_experts.experts.dtype == np.uint16
    assert pickle.loads(pickle.dumps(rollout)) == rollout
    piece, _ = _rollout(128, prompt=(1, 2, 3, 4, 5), response=(6, 7, 8))  # the engine fed prompt + prefix
    whole = extend(rollout, piece)
    assert whole.response_ids == [4, 5, 6, 7, 8] and whole.routed_experts == piece.routed_experts


def test_a_checkpoint_with_flat_int_routes_still_resumes():
    rollout, routes = _rollout(128)
    old = {**rollout.to_json(), "routed_experts": routes.reshape(-1).tolist()}  # as written before
    assert Rollout.from_json(old) == rollout
    assert Rollout.from_json({**old, "routed_experts": []}).routed_experts is None
