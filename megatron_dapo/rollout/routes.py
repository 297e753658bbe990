"""An MoE rollout's routes (moe.router_replay=R3) in the fewest bytes that hold them.

A route is the experts each layer sent each token to: [tokens fed to the engine, layers x top-k]
(prompt + response - 1 tokens: the last token is never fed). At Qwen3-30B-A3B's 48 layers x top-8
that is 384 numbers a token, ~7.9M for one 20k-token response and ~4e9 for a step of 512: as Python
ints (28 bytes each, plus the list's 8-byte pointer) 140 GB, as one byte each 3.9 GB. Experts are
numbered below the expert count (128 at 30B-A3B), so one unsigned byte holds them up to 256 experts,
two bytes beyond; the array travels as it is between processes (pickle) and as base64 in a
checkpoint's trainer state (a carried partial response, a batch asked for ahead).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class Routes:
    """``experts``: [tokens fed, layers x k], uint8 (experts < 256) or uint16."""

    experts: np.ndarray

    def __post_init__(self):
        if self.experts.ndim != 2 or self.experts.dtype not in (np.uint8, np.uint16):
            raise ValueError(f"routes must be [tokens, layers x k] uint8 or uint16, got {self.experts.shape} "
                             f"{self.experts.dtype}")

    @classmethod
    def of(cls, experts: Any, tokens: int) -> "Routes":
        """Any integer array or tensor of ``tokens`` x (layers x k) experts (flat or shaped), in the
        smallest dtype that holds its largest expert."""
        array = experts.numpy() if isinstance(experts, torch.Tensor) else np.asarray(experts)
        if tokens < 1 or array.size % tokens:
            raise ValueError(f"{array.size} routed experts for {tokens} tokens fed to the engine")
        array = array.reshape(tokens, -1)
        if array.size and (array.min() < 0 or array.max() >= 1 << 16):
            raise ValueError(f"expert indices must be in [0, 65536), got {array.min()} .. {array.max()}")
        dtype = np.uint8 if not array.size or array.max() < 256 else np.uint16
        return cls(np.ascontiguousarray(array, dtype=dtype))

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    def __eq__(self, other) -> bool:
        return isinstance(other, Routes) and np.array_equal(self.experts, other.experts)

    def tensor(self) -> torch.Tensor:
        """[tokens, layers x k] int16 (batching.Sample.routed_experts)."""
        return torch.from_numpy(self.experts.astype(np.int16))

    def to_json(self) -> dict:
        return {"shape": list(self.experts.shape), "dtype": self.experts.dtype.name,
                "data": base64.b64encode(self.experts.tobytes()).decode("ascii")}

    @classmethod
    def from_json(cls, data: dict) -> "Routes":
        raw = np.frombuffer(base64.b64decode(data["data"]), dtype=np.dtype(data["dtype"]))
        return cls(raw.reshape(data["shape"]).copy())
