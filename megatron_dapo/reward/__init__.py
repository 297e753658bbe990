"""Rule-based rewards: scorers by name, and a process pool that bounds their time.

Two scorers are registered (docs/reward.md):
- "dapo_math" (VALUE_REWARD_FN, math_dapo.py): ours, compares the VALUE of the answer with the
  integer ground truth; the training default.
- "math_dapo_paper" (PAPER_REWARD_FN, paper_rule.py): the paper's / verl <= 0.9.0's rule, exact string match
  of the normalised last "Answer:" in the last 300 characters; the evaluation default, the number
  to set beside the paper's.
"""

from megatron_dapo.registry import Registry
from megatron_dapo.reward import paper_rule
from megatron_dapo.reward.math_dapo import compute_score, quick_score
from megatron_dapo.reward.pool import RewardPool

__all__ = ["PAPER_REWARD_FN", "QUICK_FNS", "REWARD_FNS", "VALUE_REWARD_FN", "RewardPool", "compute_score",
           "get_reward_fn"]

VALUE_REWARD_FN = "dapo_math"
PAPER_REWARD_FN = "math_dapo_paper"

# A reward fn maps (response, ground_truth) to {"score": float, "acc": bool, "pred": str}. It must be a
# module-level function (RewardPool's worker processes import it by name) that reads at most the last
# math_dapo.TAIL_CHARS characters of the response (the pool sends only those).
REWARD_FNS: Registry = Registry("reward fn")
REWARD_FNS.register(VALUE_REWARD_FN)(compute_score)
REWARD_FNS.register(PAPER_REWARD_FN)(paper_rule.compute_score)
# Quick companions (RewardPool's quick_fns): bounded pure Python, run in the trainer's process; a
# None goes to the workers. The paper's rule is string work on 300 characters, always decided.
QUICK_FNS = {VALUE_REWARD_FN: quick_score, PAPER_REWARD_FN: paper_rule.compute_score}


def get_reward_fn(name: str):
    """The reward fn registered as ``name`` (ValueError listing the valid names)."""
    return REWARD_FNS.get(name)
