"""The verdict on a candidate from its drop against the baseline, in percentage points.

    drop <= 1.5   normal
    1.5 < drop <= 3   look at the categories
    drop > 3      roll back to a less aggressive format

A candidate that scores higher than its baseline (a negative drop) is normal.
"""

from __future__ import annotations

NORMAL_PP = 1.5
LOOK_PP = 3.0
NORMAL = "normal"
LOOK = "look at the categories"
ROLL_BACK = "roll back to a less aggressive format"
# The command's exit status per verdict (2 is a usage error, as for every command).
EXIT_STATUS = {NORMAL: 0, LOOK: 1, ROLL_BACK: 3}


def verdict(drop_pp: float) -> str:
    # Rounded first: a drop of exactly 1.5 or 3 points computed in floats stays on its edge.
    drop = round(drop_pp, 9)
    if drop <= NORMAL_PP:
        return NORMAL
    if drop <= LOOK_PP:
        return LOOK
    return ROLL_BACK


def percent(correct: int, total: int) -> float:
    return 100.0 * correct / total if total else 0.0
