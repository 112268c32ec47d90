"""Gradient ranges that no other member's contribution reached count as no gradient for that step.

Over a lossy link, a range of the averaged gradient can miss every other member: the owner heard no other sender
for it, or its all-gather datagram to this member was lost. The daemon then hands back this member's own values
for the range, exactly (protocol/allreduce.md, "Reconstruction"). Applied as they are, those values are one
member's gradient where the rest of the vector averages the group's: a group of n adds up to n times the
variance on them, and each replica steps its own way. Left out instead (zero for that step), the step shrinks
there by the share lost (10 % loss: an optimizer step about 5-10 % shorter on a tenth of the values, each step
a different tenth), the variance stays the group's, and replicas differ only by the average they missed.

Such ranges are found by what the daemon's rule makes certain: the result equals this member's own value
bit for bit. Values that all members share (a gradient of exactly zero) are zero either way. A result that
equals the member's own almost everywhere is not a loss pattern but a group that contributed the same numbers
(SameData warns about it) or averaged alone: it is applied unchanged.
"""

from __future__ import annotations

import torch

MAX_UNRECEIVED_SHARE = 0.5  # above this share of values equal to this member's own, nothing is left out


def drop_unreceived(result: torch.Tensor, own: list[torch.Tensor | None], numels: list[int]) -> int:
    """Zero, in the flat averaged ``result``, the values that equal this member's ``own`` gradient (tensors in
    parameter order, ``numels`` values each; None: a parameter this member did not use, never touched) and are
    not zero. Returns how many were zeroed; 0 (``result`` unchanged) when more than MAX_UNRECEIVED_SHARE of
    the values would be."""
    flats: list[tuple[int, int, torch.Tensor]] = []
    off = 0
    for t, n in zip(own, numels, strict=True):
        if t is not None:
            flats.append((off, n, t.detach().reshape(-1).to(device=result.device, dtype=result.dtype)))
        off += n
    if off != result.numel():
        raise ValueError(f"the result holds {result.numel()} values, the parameters {off}")
    equal = 0
    for o, n, t in flats:
        seg = result[o: o + n]
        equal += int(torch.count_nonzero((seg == t) & (t != 0)))
    if equal == 0 or equal > MAX_UNRECEIVED_SHARE * off:
        return 0
    with torch.no_grad():
        for o, n, t in flats:
            seg = result[o: o + n]
            seg.masked_fill_(seg == t, 0.0)
    return equal
