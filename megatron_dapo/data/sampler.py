"""Resumable, epoch-crossing sampler of prompt indices.

The training loop asks for `k` prompt indices per step. Epochs run into each other without a
gap or a short batch: when an epoch runs out mid-request, the rest of the request comes from
the next epoch's permutation. Each epoch's order is a fixed function of (seed, epoch), so the
whole future sequence is determined by (num_items, seed, shuffle, consumed); that is all the
state there is, and a restored sampler continues exactly where the saved one stopped.
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Draws prompt indices in [0, num_items), epoch after epoch, reproducibly.

    Args:
        num_items: number of prompts, >= 1.
        seed: non-negative integer; epoch e uses the permutation seeded with [seed, e].
        shuffle: False gives 0, 1, ..., num_items - 1 every epoch (for evaluation).
    """

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True):
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
            raise ValueError(f"num_items must be a positive integer, got {num_items!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self._num_items = num_items
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._consumed = 0
        self._order_epoch = -1  # which epoch `_order` belongs to; -1 = none computed yet
        self._order: list[int] = []

    @property
    def num_items(self) -> int:
        return self._num_items

    @property
    def consumed(self) -> int:
        """Indices drawn so far, over all epochs."""
        return self._consumed

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (0-based)."""
        return self._consumed // self._num_items

    def epoch_order(self, epoch: int) -> list[int]:
        """The full index order of `epoch`."""
        if not self._shuffle:
            return list(range(self._num_items))
        # A [seed, epoch] seed sequence, not seed + epoch: with a sum, seed 1 epoch 0 would
        # repeat seed 0 epoch 1, so two "different" seeds would give shifted copies of one stream.
        rng = np.random.default_rng([self._seed, epoch])
        return rng.permutation(self._num_items).tolist()

    def next_indices(self, k: int) -> list[int]:
        """The next `k` indices, continuing into the next epoch when this one runs out."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be a non-negative integer, got {k!r}")
        out: list[int] = []
        while len(out) < k:
            epoch, offset = divmod(self._consumed, self._num_items)
            if epoch != self._order_epoch:
                self._order, self._order_epoch = self.epoch_order(epoch), epoch
            take = min(k - len(out), self._num_items - offset)
            out.extend(self._order[offset:offset + take])
            self._consumed += take
        return out

    def state_dict(self) -> dict:
        """JSON-serialisable state; `consumed` is the only part that changes."""
        return {"num_items": self._num_items, "seed": self._seed, "shuffle": self._shuffle,
                "consumed": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; the sampler must be built with the same arguments."""
        expected = {"num_items", "seed", "shuffle", "consumed"}
        if set(state) != expected:
            raise ValueError(f"sampler state must have keys {sorted(expected)}, got {sorted(state)}")
        for name, mine in (("num_items", self._num_items), ("seed", self._seed),
                           ("shuffle", self._shuffle)):
            if state[name] != mine:
                raise ValueError(f"sampler state has {name}={state[name]!r} but this sampler has "
                                 f"{name}={mine!r}; a resumed run must use the same prompt set and seed")
        consumed = state["consumed"]
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"sampler state 'consumed' must be a non-negative integer, got {consumed!r}")
        self._consumed = consumed
