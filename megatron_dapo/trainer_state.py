"""Where a run is, between two steps: what a checkpoint holds besides the weights and the optimizer.

One typed object, written by the loop at a save (``trainer_state.json`` beside the dist checkpoint,
plain JSON so that set-up reads it before any model is built) and read back by set-up on resume.
Each component keeps its own state format (the prompt sampler's, the step clock's); the held prompt
groups of ``filter_groups.surplus=carry`` are serialised by ``Group`` itself (groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.errors import InputError
from megatron_dapo.groups import Group


@dataclass(frozen=True, kw_only=True)
class TrainerState:
    step: int
    """Completed rollout steps: the checkpoint at step N already holds step N's metrics record."""
    sampler: dict
    """``PromptSampler.state_dict()``: the position in the shuffled training prompts."""
    held_groups: tuple[Group, ...] = ()
    """Kept prompt groups beyond the step's batch, carried into the next step (surplus=carry)."""
    responses_generated: int = 0
    """Every response generated so far, kept or not (train.generation_budget counts these)."""
    clock: dict = field(default_factory=dict)
    """``StepClock.state_dict()``: recent step and save durations, for the job's time limit."""
    ledger: dict = field(default_factory=dict)
    """``PassRateLedger.state()``: every drawn prompt's attempts, correct responses and solved streak."""
    alarms: tuple[str, ...] = ()
    """The alarms raised at this step (observe/alarms.py): a resumed run warns where the first would."""
    alarm_streaks: dict[str, int] = field(default_factory=dict)
    """{alarm: steps in a row its metric has been across its threshold}, for the alarms raised only
    when that lasts (observe/alarms.py), of those not raised yet."""
    keep_rate: float | None = None
    """Dynamic sampling's keep rate measured so far (algorithm.filter_groups.adaptive sizes batches by it)."""
    ahead: tuple[dict, ...] = ()
    """Generation batches asked for ahead and collected at a stop (``RolloutPipeline.to_json``;
    rollout.max_staleness >= 1): the next steps' first batches, with their rollouts."""
    carried: tuple[dict, ...] = ()
    """rollout.partial: the prompt groups whose responses are still growing (``Carried.to_json``,
    rollout/partial.py), continued by the next generation batch."""

    def to_json(self) -> dict:
        return {"step": self.step, "sampler": self.sampler, "held_groups": [g.to_json() for g in self.held_groups],
                "responses_generated": self.responses_generated, "clock": self.clock, "ledger": self.ledger,
                "alarms": list(self.alarms), "alarm_streaks": self.alarm_streaks, "keep_rate": self.keep_rate,
                "ahead": list(self.ahead), "carried": list(self.carried)}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "TrainerState":
        """The state ``to_json`` wrote; InputError naming ``where`` (the file) when a key is missing
        or unknown (a checkpoint of another version of this code). ``ledger`` and ``alarms`` came later:
        a checkpoint without them resumes with an empty ledger and no alarm raised; ``alarm_streaks``,
        ``keep_rate``, ``ahead`` and ``carried`` too (no streak, nothing measured, asked for ahead or
        carried)."""
        keys = {"step", "sampler", "held_groups", "responses_generated", "clock"}
        if not isinstance(data, dict) or not keys <= set(data) <= keys | {"ledger", "alarms", "keep_rate",
                                                                          "ahead", "carried", "alarm_streaks"}:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise InputError(f"{where}: trainer state with keys {got}, expected {sorted(keys)}: a checkpoint of "
                             "another version of megatron-dapo; resume it with that version, or start a new "
                             "logging.dir")
        return cls(step=int(data["step"]), sampler=data["sampler"],
                   held_groups=tuple(Group.from_json(g) for g in data["held_groups"]),
                   responses_generated=int(data["responses_generated"]), clock=data["clock"],
                   ledger=data.get("ledger", {}), alarms=tuple(data.get("alarms", ())),
                   alarm_streaks=dict(data.get("alarm_streaks", {})),
                   keep_rate=data.get("keep_rate"), ahead=tuple(data.get("ahead", ())),
                   carried=tuple(data.get("carried", ())))
