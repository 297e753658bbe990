"""A model of the training step's timeline under each rollout placement (a discrete-event simulation).

Two resources: the trainers and the engines. Colocated, they take turns on the same devices, so a
step lasts its generation batches plus its trainer work. Separate (rollout/separate.py), the engines
work through a queue in the order asked (generation batches, weight loads) while the trainers
score, train and send weights; which batches are asked for ahead is the loop's own rule
(rollout/pipeline.py, imported, not restated). The simulation replays that protocol event by event:

    trainer, step s:  take its first batch (asked for ahead: wait for it; else ask now and wait),
                      score it; each further batch: ask, wait, score; ask ahead for later steps;
                      train; wait for the engines to finish what is queued; send the weights
    engines:          one queue, one job at a time: a generation batch, a weight load

The wait before the send is the protocol's (rollout/engine_server.py): an engine receives a weight
version only between generation batches, into the model (it holds no second copy), so the trainers
send it once the engines have generated every batch asked for before it. At k = 1 that is the batch
the next step takes anyway; at k >= 2 it is every batch asked ahead, so the trainers run at most one
batch ahead of the engines: k >= 2 adds lag, not overlap. The send's own seconds are counted in
``train``, before the wait.

Inputs are seconds per phase (``StepWork``): measured on the CPU run (benchmarks/async_rollout.py
checks the model's ratios against measured ones) or estimated at scale, where a batch's generation
seconds come from ``continuous_batching_seconds``: a replica decoding its share of responses with a
bounded number of sequences at once, each decode step costing the weights' read plus each live
sequence's KV read (docs/async_rollouts.md has the 32B projection and every assumption).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_dapo.rollout.pipeline import RolloutPipeline


@dataclass(frozen=True)
class StepWork:
    """One step's work in seconds."""

    generation: tuple[float, ...]  # the engines' time for each generation batch of the step, in order
    score: float  # the trainers' time after each batch arrives (scoring, dynamic sampling)
    train: float  # the trainers' time after the rollout: old log-probs, updates, the weights' export and send
    load: float = 0.0  # the engines' time to load a weight version (separate; colocated it is in ``train``)


@dataclass(frozen=True)
class Timeline:
    step_s: tuple[float, ...]  # each step's seconds on the trainers, from its start to the next's
    trainer_waited_s: float  # the trainers waiting for generation (colocated: the whole generation)
    engines_idle_s: float  # the engines with nothing queued, from their first job to the last step's end

    @property
    def total_s(self) -> float:
        return sum(self.step_s)


def colocated(work: Sequence[StepWork]) -> Timeline:
    """Generation and training take turns on the same ranks: nothing overlaps."""
    steps = tuple(sum(w.generation) + len(w.generation) * w.score + w.train for w in work)
    generating = sum(sum(w.generation) for w in work)
    return Timeline(steps, trainer_waited_s=generating, engines_idle_s=sum(steps) - generating)


def separate(work: Sequence[StepWork], *, max_staleness: int, save_every: int = 0) -> Timeline:
    """The separate placement's timeline at ``max_staleness`` (module doc); the steps are the run's
    whole length (no batch is asked for past the last, as the loop does)."""
    engines = _Queue()
    pipeline = RolloutPipeline(max_staleness, len(work), save_every)
    ahead: dict[int, float] = {}  # step -> when its first batch, asked for ahead, is done
    now = waited = 0.0
    steps = []
    for s, w in enumerate(work):
        start = now
        for j, seconds in enumerate(w.generation):
            done = ahead.pop(s) if j == 0 and s in ahead else engines.run(seconds, asked=now)
            waited += max(0.0, done - now)
            now = max(now, done) + w.score
        for target in pipeline.targets(s, finished=False):
            ahead[target] = engines.run(work[target].generation[0], asked=now)
        now += w.train
        waited += max(0.0, engines.free_at - now)  # the weights go in after every batch asked for before them
        now = max(now, engines.free_at)
        engines.run(w.load, asked=now)
        steps.append(now - start)
    return Timeline(tuple(steps), trainer_waited_s=waited, engines_idle_s=engines.idle_until(now))


class _Queue:
    """The engines: jobs in the order asked, one at a time."""

    def __init__(self):
        self.free_at = 0.0
        self.idle = 0.0
        self.started = False

    def run(self, seconds: float, *, asked: float) -> float:
        """Queues a job asked at ``asked``; returns when it ends."""
        begin = max(asked, self.free_at)
        if self.started:
            self.idle += begin - self.free_at
        self.started = True
        self.free_at = begin + seconds
        return self.free_at

    def idle_until(self, end: float) -> float:
        return self.idle + max(0.0, end - self.free_at)


def continuous_batching_seconds(lengths: Sequence[int], *, slots: int, weights_step_s: float,
                                kv_step_s_per_token: float, prompt_tokens: int = 0,
                                prefixes: Sequence[int] = ()) -> float:
    """Seconds for one replica to decode responses of ``lengths`` tokens, ``slots`` at a time, a new
    one starting as soon as one ends (vLLM's continuous batching). A decode step costs
    ``weights_step_s`` (reading the weights, whatever the batch) plus ``kv_step_s_per_token`` per
    token of context held by the live sequences (their prompt, ``prefixes[i]`` tokens of response
    generated before this batch when it continues one (partial rollouts), and what they generated
    so far). Prefilling the prompts and prefixes is not counted.

    Simulated between events (a sequence ending), where the step cost changes; within an interval
    the context grows by one token per live sequence per step, so its cost is summed exactly.
    """
    held = list(prefixes) or [0] * len(lengths)
    pending = list(reversed(list(zip(lengths, held))))  # popped from the end: in the order asked
    live: list[tuple[int, int]] = []  # (the decode step it ends at, its prompt + prefix - the step it started)
    base = 0  # sum of the second entries over live: a live sequence's context at step t is that + t
    step = 0
    seconds = 0.0
    while pending or live:
        while pending and len(live) < slots:
            length, prefix = pending.pop()
            heapq.heappush(live, (step + length, prompt_tokens + prefix - step))
            base += prompt_tokens + prefix - step
        end = live[0][0]
        n = end - step  # decode steps until the next sequence ends
        # the live sequences' contexts summed over t in [step, end)
        context = n * (base + len(live) * step) + len(live) * n * (n - 1) / 2
        seconds += n * weights_step_s + kv_step_s_per_token * context
        step = end
        while live and live[0][0] == step:
            base -= heapq.heappop(live)[1]
    return seconds
