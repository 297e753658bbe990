"""The training loop's generation batches: drawn in their step or asked for ahead, and the carry.

A batch's prompts are drawn by the loop's order and seeded by its place in its step (``rollout_seed``), so
it is the same whether generated in its step or asked for ahead (rollout/pipeline.py). With
``rollout.partial`` a batch also continues the responses cut in earlier batches (the carry,
rollout/partial.py): its items are one response each, and only the groups complete after it go
on to scoring and dynamic sampling; the others are carried to the next batch drawn or asked for.
The carry lives with the leader of the rollout replica that answers every batch (trainer rank 0:
one colocated replica or separate placement; launch_checks.check_rollout refuses more; the other ranks hold
its groups without their rollouts, so that every rank draws the same prompts), is saved in the
trainer state, and is empty before the first step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from megatron_dapo.groups import GenBatch, generate_groups
from megatron_dapo.observe.rows import RowSpec
from megatron_dapo.preemption import StopRequest
from megatron_dapo.rollout.engine import SamplingParams, rollout_sampling_params
from megatron_dapo.rollout.partial import Carried, engine_inputs, split_complete
from megatron_dapo.rollout.pipeline import GenRequest, RolloutPipeline

logger = logging.getLogger(__name__)


def rollout_seed(seed: int, step: int, num_gen_batches: int) -> int:
    """Rollout seed of step ``step``'s generation batch after ``num_gen_batches`` others:
    reproducible across a resume, and the same whether asked for ahead or not."""
    return (seed * 1_000_003 + step) * 1_009 + num_gen_batches


class GenerationBatches:
    """One run's generation batches (module doc).

    Args:
        run: the built run (its config, sampler, inputs, placement, reward pool).
        obs: the run's Observer (prompt draws past retired prompts, dump rows).
        carried: the carry a checkpoint kept (``carry_json``), on resume.
    """

    def __init__(self, run, obs, carried: Sequence[dict] = ()):
        self.run, self.obs = run, obs
        self.partial = run.cfg.rollout.partial
        self.carry: list[Carried] = [Carried.from_json(c) for c in carried]

    def draw(self, step: int, num_gen_batches: int, size: int) -> GenRequest:
        """Step ``step``'s generation batch after ``num_gen_batches`` others: new prompts drawn now
        (retired ones skipped: data.skip_solved_after), ``size`` of them, and with partial rollouts the
        whole carry, whose groups take the first of the ``size`` places (so at most ``size`` groups
        are in flight, however long their responses)."""
        fresh = max(0, size - len(self.carry)) if self.partial else size
        ahead = GenRequest(step, self.obs.draw(self.run.sampler, fresh),
                           rollout_seed(self.run.cfg.seed, step, num_gen_batches))
        if self.partial:
            ahead.carried, self.carry = self.carry, []
        return ahead

    def submit(self, ahead: GenRequest) -> None:
        """Asks the engines for ``ahead`` and returns at once (separate placement)."""
        ahead.request = self.run.placement.submit(*self._request(ahead))

    def cancel(self, requests: list[int]) -> None:
        """Tells the engines that submitted batches will not be collected (separate placement)."""
        self.run.placement.cancel(requests)

    def await_in_flight(self, pipeline: RolloutPipeline, stop: StopRequest, *, reserve_s: float) -> None:
        """Before a step's sync (separate placement): the engines take the new weights only after the
        batches asked for before them (rollout/engine_server.py), so the sync waits for what is in
        flight, trainer rank 0 polling the engines and the other trainer ranks waiting for its word.
        Once a stop is asked for, only until ``reserve_s`` before its kill (StopRequest.deadline): the
        batches not finished by then are released (rollout/pipeline.py), aborted on the engines and
        asked for again at resume."""
        requests = pipeline.in_flight()
        if not requests:  # the same on every trainer rank
            return
        stop.agreed()  # every trainer rank learns of a signal any of them got: the deadline is rank 0's
        placement = self.run.placement
        released = pipeline.release(placement.wait_for(requests, until=lambda: stop.deadline(reserve_s)))
        placement.cancel(released, "released at the stop")
        if released and self.run.rank == 0:
            logger.warning("stop: %d generation batch(es) in flight not finished in time for the save before the "
                           "kill: saved as requests, generated again at resume from this checkpoint's weights",
                           len(released))

    def collect_in_flight(self, pipeline: RolloutPipeline) -> None:
        """The batches in flight at a stop, kept with the checkpoint: every one the last sync did not
        release is finished (the sync waited for it)."""
        pipeline.collect_in_flight(lambda request: self.run.placement.collect(request)[1])

    def scored_groups(self, ahead: GenRequest, *, keep: Callable[[torch.Tensor], torch.Tensor], rows: RowSpec | None,
                 carry_all: bool = False) -> tuple[GenBatch, list[int]]:
        """``ahead``'s scored groups (groups.generate_groups, ``carry_all`` as there) and their prompts,
        on every rank; its rollouts from a stop's checkpoint, from the engines' answer to ``submit``,
        or generated now."""
        run, cfg = self.run, self.run.cfg
        placement, inputs = run.placement, run.inputs
        fetch, indices = self._fetch(ahead), ahead.indices
        if self.partial:
            outputs = fetch()[1] if fetch is not None else placement.generate(*self._request(ahead))[1]
            complete: list[Carried] = []
            cut: list[Carried] = []
            if placement.is_leader:
                complete, cut = split_complete(ahead.indices, cfg.rollout.n, ahead.carried, outputs,
                                      cfg.rollout.max_response_length)
            # every rank learns which groups completed and which go on: the carry's size decides how
            # many new prompts the next draw takes from the sampler, which every rank keeps in step
            indices, going_on = placement.gather([([g.prompt_index for g in complete], [g.prompt_index for g in cut])]
                                                 if placement.is_leader else [])[0]
            self.carry += cut if placement.is_leader else [Carried(i, []) for i in going_on]
            fetch = lambda: (range(len(complete)), [g.rollouts for g in complete])  # noqa: E731
        batch = generate_groups(placement, inputs.train_ids, indices, ground_truths=inputs.train_truths,
                                tokenizer=inputs.tokenizer, params=self._params(ahead), pool=run.pool, cfg=cfg,
                                keep=keep, rows=rows, fetch=fetch, carry_all=carry_all)
        return batch, indices

    def abort_carry(self) -> int:
        """Drops the carry (rollout.partial_unfinished=abort, at a full step) and returns the response
        tokens its groups held: the leader's count (elsewhere the groups hold no rollouts)."""
        tokens = sum(len(r.response_ids) for c in self.carry for r in c.rollouts)
        self.carry = []
        return tokens

    def carry_json(self) -> list[dict]:
        """The carry, for the trainer state (the leader's; elsewhere the groups without rollouts)."""
        return [c.to_json() for c in self.carry]

    def _params(self, ahead: GenRequest) -> SamplingParams:
        run = self.run
        return rollout_sampling_params(run.cfg.rollout, seed=ahead.seed, stop_token_ids=run.inputs.stops)

    def _request(self, ahead: GenRequest) -> tuple[list[list[int]], int, SamplingParams]:
        """What the engines generate for ``ahead``: (prompts, responses per prompt, params)."""
        run, r = self.run, self.run.cfg.rollout
        params, train_ids = self._params(ahead), run.inputs.train_ids
        if not self.partial:
            return [train_ids[i] for i in ahead.indices], r.n, params
        batch = run.placement.from_leader(engine_inputs(train_ids, ahead.indices, r.n, ahead.carried,
                                                        r.max_response_length))
        return batch, 1, dataclasses.replace(params, max_tokens=r.piece_tokens)

    def _fetch(self, ahead: GenRequest):
        """Where a batch's rollouts come from: a stop's saved ones, the engines' answer to an
        earlier request, or (None) a generation now."""
        placement = self.run.placement
        if ahead.rollouts is not None:
            saved = ahead.rollouts if placement.is_leader else []
            return lambda: (range(len(saved)), saved)
        if ahead.request is not None:
            return lambda: placement.collect(ahead.request)
        return None
