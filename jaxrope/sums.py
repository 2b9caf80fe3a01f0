"""Sums that could pass int32, checked before the int32 arithmetic forms them.

The transitions of :mod:`jaxrope.positions` add counts, amounts, deltas and depths to
int32 counters. Where those values are concrete (outside ``jax.jit``) the sums are
formed here in int64 on the host first, and a sum past int32 is refused naming the
argument, so no counter or position wraps. Traced values are the checked mode's
(:mod:`jaxrope.checks`).

Example:
  >>> import numpy as np
  >>> counters_fit("counts", np.array([2**31 - 2], np.int32), np.array([0]), np.array([5]), 2**31 - 1)
  Traceback (most recent call last):
  ...
  ValueError: counts would carry row 0 from 2147483646 to 2147483651, past the int32 counters' 2147483647
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxrope.int_arrays import INT32, host

__all__ = ["counters_fit", "plan_fits"]


def counters_fit(name: str, counters, rows, amounts, pad: int) -> None:
    """Concrete ``counters`` plus ``amounts`` at ``rows`` (``pad`` rows skipped) stay
    within int32."""
    counters, rows, amounts = host(counters), host(rows), host(amounts)
    if counters is None or rows is None or amounts is None:
        return
    live = rows != pad
    after = counters.astype(np.int64)
    np.add.at(after, rows[live], amounts[live].astype(np.int64))
    if (after > INT32.max).any():
        row = int(np.flatnonzero(after > INT32.max)[0])
        raise ValueError(f"{name} would carry row {row} from {counters[row]} to {after[row]}, "
                         f"past the int32 counters' {INT32.max}")


def plan_fits(counters, deltas, rows, counts, depths, sequential: bool, pad: int) -> None:
    """Concrete positions a plan forms (counter, + delta where ``deltas`` is given, + index
    or depth) fit int32: computed in int64 before the int32 arithmetic could wrap."""
    columns = [host(counters)] + ([host(deltas)] if deltas is not None else [])
    rows, counts = host(rows), host(counts)
    given: Optional[np.ndarray] = None if depths is None else host(depths)
    if rows is None or counts is None or any(c is None for c in columns) or (
            depths is not None and given is None):
        return
    live = np.flatnonzero((rows != pad) & (counts > 0))
    if not live.size:
        return
    base = sum(c[rows[live]].astype(np.int64) for c in columns)
    if given is not None:
        view = np.repeat(np.arange(live.size), counts[live])
        starts = np.concatenate([[0], np.cumsum(counts)])[live]
        token = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts[live])])
        low = high = base[view] + given[token].astype(np.int64)
        live = live[view]
    else:
        low = base
        high = base + (counts[live].astype(np.int64) - 1 if sequential else 0)
    bad = np.flatnonzero((high > INT32.max) | (low < INT32.min))
    if bad.size:
        i, v = bad[0], live[bad[0]]
        what = "counts" if depths is None else "depths"
        at = high[i] if high[i] > INT32.max else low[i]
        raise ValueError(f"{what} would number row {rows[v]} (counts[{v}]={counts[v]}) at "
                         f"{at}, outside the int32 positions [{INT32.min}, {INT32.max}]")
