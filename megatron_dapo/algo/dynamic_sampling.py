"""Dynamic sampling (DAPO section 3.2): keep only prompt groups whose answers are mixed.

A group whose responses are all correct or all wrong has no correctness signal (a zero advantage
everywhere, unless overlong shaping sets its responses' lengths apart); DAPO drops it and keeps
drawing generation batches until ``prompts_per_step`` useful groups are held (Eq. 11: 0 < #correct
< G). The filter reads correctness (``acc``), not the length-shaped score, as the verl recipe does
with ``filter_groups.metric=acc``.

Usage, one training step::

    sampler.start_step()
    while not sampler.is_full:
        groups, acc = generate_and_score(next_prompts)   # acc: [P, G] bool
        sampler.add(groups, acc)                          # max_num_gen_batches spent: raises, or fills
    groups, metrics = sampler.pop()

When ``max_num_gen_batches`` batches do not fill the step (verl raises then: its most reported DAPO
failure), ``on_exhausted="fill"`` fills the rest with groups of the last batch whose answers all
agree, logged and counted (``dynamic_sampling/num_filled``): they carry no correctness signal, so the
step learns correctness from the mixed groups it found, its gradient scaled down by the token-level normalisation over
the filled groups' tokens. The last batch's dropped groups must then travel (``carries_all``).
"""

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


class DynamicSamplingExhausted(RuntimeError):
    """Raised when max_num_gen_batches generation batches did not yield a full train batch."""


@dataclass
class _StepCounts:
    num_gen_batches: int = 0
    num_groups: int = 0
    num_kept: int = 0
    num_all_correct: int = 0
    num_all_wrong: int = 0
    num_responses: int = 0
    num_filled: int = 0
    pass_histogram: list[int] = field(default_factory=list)  # index k: groups with k correct


class DynamicSampler:
    """Accumulates prompt groups across generation batches until a train batch is full.

    Args:
        prompts_per_step: groups a train batch needs.
        group_size: responses per prompt (G).
        max_num_gen_batches: give up after this many generation batches in one step (0 = never).
        enabled: False keeps every group (plain GRPO batches), so the first generation batch of
            ``prompts_per_step`` prompts fills the batch.
        surplus: what happens to kept groups beyond ``prompts_per_step``: "drop" (the paper and
            verl) or "carry" them into the next step's batch (they are then one step off-policy).
        adaptive: ``request_size`` sizes each generation batch from the measured keep rate instead
            of the fixed size it is given.
        max_request: with ``adaptive``, the largest generation batch (0: 4 x the fixed size).
        on_exhausted: "error" (raise DynamicSamplingExhausted) or "fill" (module doc) when
            ``max_num_gen_batches`` batches leave the step short.
    """

    MARGIN = 0.1  # asked beyond missing / keep rate: one batch then usually fills the step

    def __init__(self, *, prompts_per_step: int, group_size: int, max_num_gen_batches: int,
                 enabled: bool = True, surplus: str = "drop", adaptive: bool = False, max_request: int = 0,
                 on_exhausted: str = "error"):
        if surplus not in ("drop", "carry"):
            raise ValueError(f"surplus must be 'drop' or 'carry', got {surplus!r}")
        if on_exhausted not in ("error", "fill"):
            raise ValueError(f"on_exhausted must be 'error' or 'fill', got {on_exhausted!r}")
        self.on_exhausted = on_exhausted
        if prompts_per_step < 1 or group_size < 1 or max_num_gen_batches < 0:
            raise ValueError(f"bad sizes: prompts_per_step={prompts_per_step}, group_size={group_size}, "
                             f"max_num_gen_batches={max_num_gen_batches}")
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.max_num_gen_batches = max_num_gen_batches
        self.enabled = enabled
        self.surplus = surplus
        self.adaptive, self.max_request = adaptive, max_request
        self.keep_rate: float | None = None  # kept / generated groups, averaged over batches (halving weights)
        self._held: list[Any] = []
        self._carried_in = 0
        self._counts = _StepCounts(pass_histogram=[0] * (group_size + 1))

    def start_step(self) -> None:
        """Resets the per-step counters; carried-over groups (surplus="carry") stay held."""
        self._counts = _StepCounts(pass_histogram=[0] * (self.group_size + 1))
        self._carried_in = len(self._held)

    @property
    def is_full(self) -> bool:
        return len(self._held) >= self.prompts_per_step

    @property
    def num_gen_batches(self) -> int:
        """Generation batches added since ``start_step``."""
        return self._counts.num_gen_batches

    def request_size(self, fixed: int) -> int:
        """Prompts to ask for in the next generation batch: ``fixed`` (data.gen_prompts_per_batch),
        or with ``adaptive`` the groups still missing divided by the keep rate measured so far,
        plus MARGIN, between the missing count and ``max_request`` (4 x ``fixed`` when 0). With
        the filter off every group is kept: ``fixed``."""
        if not (self.enabled and self.adaptive) or self.keep_rate is None:
            return fixed
        missing = max(1, self.prompts_per_step - len(self._held))
        cap = max(missing, self.max_request or 4 * fixed)
        wanted = missing * (1 + self.MARGIN) / max(self.keep_rate, missing / cap)
        return max(missing, min(cap, math.ceil(wanted - 1e-9)))  # 11.000000000000002 asks for 11

    def ahead_request_size(self, fixed: int, steps_ahead: int) -> int:
        """Prompts to ask for in the first batch of the step ``steps_ahead`` after this one (a batch
        asked for ahead, after ``pop``): none when the groups held now fill every step up to it on
        their own, else ``request_size``. Such a batch is taken in its step even when held groups
        fill it; asked for at full size two or more steps ahead, each step held more groups than it
        trained and the held groups, and their lag, grew without bound (surplus="carry")."""
        return 0 if len(self._held) >= steps_ahead * self.prompts_per_step else self.request_size(fixed)

    def carries_all(self) -> bool:
        """Whether the next batch's dropped groups must come with their payloads: it is the step's
        last allowed one and an exhausted step fills from it (``on_exhausted="fill"``)."""
        return (self.on_exhausted == "fill" and self.enabled
                and 0 < self.max_num_gen_batches == self._counts.num_gen_batches + 1)

    def keep_mask(self, acc: torch.Tensor) -> torch.Tensor:
        """[P, G] correctness -> [P] bool: the groups ``add`` would keep (mixed answers, or all
        when disabled). Lets a rollout replica filter its share before anything travels."""
        num_correct = torch.as_tensor(acc).bool().sum(dim=-1)
        if not self.enabled:
            return torch.ones_like(num_correct, dtype=torch.bool)
        return (num_correct > 0) & (num_correct < self.group_size)

    def add(self, groups: Sequence[Any], acc: torch.Tensor) -> torch.Tensor:
        """Adds one generation batch.

        Args:
            groups: P opaque per-prompt payloads (the rollouts of one prompt each); a dropped
                group's payload is only stored to fill an exhausted step (``carries_all``), so it may
                be None otherwise.
            acc: [P, G] bool (or 0/1) correctness of each response.

        Returns:
            [P] bool, which groups were kept.

        Raises:
            DynamicSamplingExhausted: the batch is still not full after ``max_num_gen_batches``
                (with on_exhausted="fill": and this batch's dropped groups cannot fill it).
        """
        acc = torch.as_tensor(acc).bool()
        if acc.dim() != 2 or acc.shape != (len(groups), self.group_size):
            raise ValueError(f"acc must be [{len(groups)}, {self.group_size}], got {tuple(acc.shape)}")
        num_correct = acc.sum(dim=-1)
        all_correct = num_correct == self.group_size
        all_wrong = num_correct == 0
        keep = self.keep_mask(acc)

        c = self._counts
        c.num_gen_batches += 1
        c.num_groups += len(groups)
        c.num_responses += acc.numel()
        c.num_kept += int(keep.sum())
        if self.enabled:
            c.num_all_correct += int(all_correct.sum())
            c.num_all_wrong += int(all_wrong.sum())
        for k in num_correct.tolist():
            c.pass_histogram[k] += 1
        self._held.extend(g for g, k in zip(groups, keep.tolist()) if k)
        if len(groups):
            rate = int(keep.sum()) / len(groups)
            self.keep_rate = rate if self.keep_rate is None else (self.keep_rate + rate) / 2

        if not self.is_full and 0 < self.max_num_gen_batches <= c.num_gen_batches:
            spare = [(g, k) for g, kept, k in zip(groups, keep.tolist(), num_correct.tolist())
                     if not kept and g is not None]
            missing = self.prompts_per_step - len(self._held)
            if self.on_exhausted == "error":
                raise DynamicSamplingExhausted(self._exhausted_message())
            if len(spare) < missing:
                raise DynamicSamplingExhausted(self._exhausted_message(
                    f" algorithm.filter_groups.on_exhausted=fill cannot complete the batch: the last generation batch "
                    f"has {len(spare)} other groups for its {missing} empty slots."))
            fill = [k for _, k in spare[:missing]]
            num_fill_correct = sum(k == self.group_size for k in fill)
            # Measured before the fill: the message must count only the mixed groups, which alone
            # carry a correctness signal.
            message = self._exhausted_message(
                f" Filled the other {missing} slots (algorithm.filter_groups.on_exhausted=fill) with groups of the "
                f"last batch whose answers all agree ({num_fill_correct} all correct, {missing - num_fill_correct} "
                f"all wrong), which carry no correctness signal (only the overlong penalty's, where their lengths "
                f"differ): " + (f"this step learns correctness only from its {len(self._held)} mixed groups."
                                if self._held else "this step learns nothing about correctness."))
            self._held.extend(g for g, _ in spare[:missing])
            c.num_filled += missing
            logger.warning("%s", message)
        return keep

    def pop(self) -> tuple[list[Any], dict[str, float]]:
        """Returns the train batch (exactly ``prompts_per_step`` groups) and this step's metrics."""
        if not self.is_full:
            raise RuntimeError(f"pop() before the batch is full: {len(self._held)}/{self.prompts_per_step}")
        batch = self._held[: self.prompts_per_step]
        rest = self._held[self.prompts_per_step:]
        self._held = rest if self.surplus == "carry" else []
        c = self._counts
        used_responses = self.prompts_per_step * self.group_size
        hist = c.pass_histogram
        metrics = {
            "dynamic_sampling/num_gen_batches": float(c.num_gen_batches),
            "dynamic_sampling/num_groups_generated": float(c.num_groups),
            "dynamic_sampling/num_groups_kept": float(c.num_kept),
            "dynamic_sampling/num_dropped_all_correct": float(c.num_all_correct),
            "dynamic_sampling/num_dropped_all_wrong": float(c.num_all_wrong),
            "dynamic_sampling/num_groups_carried_in": float(self._carried_in),
            "dynamic_sampling/num_surplus_" + ("carried" if self.surplus == "carry" else "dropped"):
                float(len(rest)),
            "dynamic_sampling/responses_per_used_response": c.num_responses / used_responses,
            "dynamic_sampling/mean_pass_rate": (
                sum(k * n for k, n in enumerate(hist)) / max(1, sum(hist)) / self.group_size),
            # Over every group generated this step, kept or not, with the filter on or off (the
            # paper's motivation for dynamic sampling: the share of groups with no gradient).
            "dynamic_sampling/frac_all_wrong": hist[0] / max(1, sum(hist)),
            "dynamic_sampling/frac_all_correct": hist[-1] / max(1, sum(hist)),
            **({"dynamic_sampling/keep_rate_estimate": self.keep_rate} if self.adaptive else {}),
            **({"dynamic_sampling/num_filled": float(c.num_filled)} if self.on_exhausted == "fill" else {}),
        }
        return batch, metrics

    @property
    def held(self) -> tuple[Any, ...]:
        """The groups held between steps (only non-empty with surplus="carry"): what a checkpoint
        keeps (trainer_state.py)."""
        return tuple(self._held)

    def restore_held(self, groups: Sequence[Any], keep_rate: float | None = None) -> None:
        """On resume, before the first ``start_step``: the groups ``held`` returned at the save,
        and the ``keep_rate`` measured until then."""
        self._held = list(groups)
        self.keep_rate = keep_rate

    def _exhausted_message(self, outcome: str = "") -> str:
        """Why the step is short, then ``outcome`` (what was done about it), then what to change."""
        c = self._counts
        hist = ", ".join(f"{k}/{self.group_size} correct: {n}" for k, n in enumerate(c.pass_histogram) if n)
        carried = f" ({self._carried_in} carried over from the last step)" if self._carried_in else ""
        if c.num_all_correct > c.num_all_wrong:
            verdict = "too easy"
        elif c.num_all_wrong > c.num_all_correct:
            verdict = "too hard"
        else:
            verdict = "too easy or too hard"
        return (
            f"dynamic sampling collected {len(self._held)} of {self.prompts_per_step} mixed prompt groups{carried} "
            f"after {c.num_gen_batches} generation batches (max_num_gen_batches={self.max_num_gen_batches}); "
            f"{c.num_all_correct} groups were all correct and {c.num_all_wrong} all wrong. "
            f"Pass-rate histogram over {c.num_groups} groups: {hist}.{outcome} The data is {verdict} "
            f"for this model: raise algorithm.filter_groups.max_num_gen_batches (0 = unbounded), "
            f"raise data.gen_prompts_per_batch (or set algorithm.filter_groups.adaptive=true: batches sized by "
            f"the keep rate), or use data matched to the model."
        )
