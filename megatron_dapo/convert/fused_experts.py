"""HF checkpoint names -> the parameters of a live transformers model, where the two differ.

transformers >= 5 keeps a Qwen3-MoE layer's experts as two fused parameters,
``mlp.experts.gate_up_proj`` [experts, 2 x moe_ffn, hidden] (each expert's gate rows, then its up
rows) and ``mlp.experts.down_proj`` [experts, hidden, moe_ffn], while checkpoints (the released ones,
and what save_pretrained writes) keep a tensor per expert: ``mlp.experts.<e>.gate_proj.weight``.
``target`` resolves a checkpoint name to the view of the live parameter it fills, so that loading a
checkpoint into an HF model and the HF engine's in-place weight sync copy per-expert tensors
without a second table. Dense names resolve to themselves.
"""

from __future__ import annotations

import re
from typing import Mapping

from torch import Tensor

_EXPERT = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def target(params: Mapping[str, Tensor], name: str) -> Tensor | None:
    """The tensor (a view into a fused parameter, or the parameter itself) that the checkpoint tensor
    ``name`` fills in ``params`` (a model's state_dict with keep_vars); None when nothing matches."""
    if name in params:
        return params[name]
    m = _EXPERT.match(name)
    if m is None:
        return None
    e = int(m["e"])
    if m["proj"] == "down_proj":
        fused = params.get(f"{m['layer']}.down_proj")
        return None if fused is None else fused[e]
    fused = params.get(f"{m['layer']}.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[e, :half] if m["proj"] == "gate_proj" else fused[e, half:]


def fused_names(params: Mapping[str, Tensor], names) -> set[str]:
    """The parameters of ``params`` that the checkpoint names ``names`` fill (with ``target``'s rule)."""
    out = set()
    for name in names:
        if name in params:
            out.add(name)
        elif (m := _EXPERT.match(name)) is not None:
            out.add(f"{m['layer']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}")
    return out
