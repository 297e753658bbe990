"""Overlong reward shaping (DAPO section 3.4).

Soft overlong punishment, Eq. 13, with L_max = ``max_response_len`` and L_cache = ``buffer_len``:
0 up to L_max - L_cache, then linear down to -1 at L_max, -1 beyond (scaled by
``penalty_factor``). It is added to the +-1 correctness score, so rewards lie in
[-1 - penalty_factor, 1]. Overlong filtering (mask the loss of truncated responses) is a separate
switch: the verl recipe's best runs leave it off because the soft penalty already covers it.
"""

import torch


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Length penalty of each response.

    Args:
        response_lengths: [N] number of generated tokens per response (int or float).
        max_response_len: L_max, the generation limit.
        buffer_len: L_cache, the length of the linear ramp; 0 < buffer_len <= max_response_len.
        penalty_factor: the penalty at L_max (1.0 in the paper).

    Returns:
        [N] float32 penalties in [-penalty_factor, 0].
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(
            f"need 0 < buffer_len <= max_response_len, got buffer_len={buffer_len}, "
            f"max_response_len={max_response_len}"
        )
    expected = max_response_len - buffer_len
    exceed = response_lengths.to(torch.float32) - expected
    return (-exceed / buffer_len * penalty_factor).clamp(min=-penalty_factor, max=0.0)


def overlong_filter_mask(is_truncated: torch.Tensor) -> torch.Tensor:
    """[N] bool truncated (finish reason "length") -> [N] float loss multiplier (0 for truncated)."""
    return (~is_truncated.bool()).to(torch.float32)
