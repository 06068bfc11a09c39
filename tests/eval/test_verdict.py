"""The verdict bands at their edges, from a drop given and from a drop counted."""

from __future__ import annotations

import pytest

from pdserve.eval.client import Reply
from pdserve.eval.items import EvalItem
from pdserve.eval.summary import summarize
from pdserve.eval.verdict import LOOK, NORMAL, ROLL_BACK, verdict


@pytest.mark.parametrize(
    ("drop_pp", "expected"),
    [
        (-5.0, NORMAL),  # the candidate is better
        (0.0, NORMAL),
        (1.5, NORMAL),
        (1.5 + 1e-6, LOOK),
        (100 * (0.875 - 0.86), NORMAL),  # 1.5 in floats is 1.5000000000000013
        (3.0, LOOK),
        (3.0 + 1e-6, ROLL_BACK),
        (100 * (0.9 - 0.87), LOOK),  # 3 in floats is 3.0000000000000027
        (40.0, ROLL_BACK),
    ],
)
def test_verdict_bands(drop_pp: float, expected: str) -> None:
    assert verdict(drop_pp) == expected


def exact_items(count: int) -> list[EvalItem]:
    return [
        EvalItem(
            id=f"i{i}",
            category="exact",
            kind="exact",
            max_tokens=4,
            prompt=f"{i},",
            answers=(str(i + 1),),
        )
        for i in range(count)
    ]


@pytest.mark.parametrize(
    ("wrong", "drop_pp", "expected"),
    [(0, 0.0, NORMAL), (3, 1.5, NORMAL), (4, 2.0, LOOK), (6, 3.0, LOOK), (7, 3.5, ROLL_BACK)],
)
def test_drop_counted_over_200_items(wrong: int, drop_pp: float, expected: str) -> None:
    items = exact_items(200)
    right = [Reply(text=item.answers[0]) for item in items]
    candidate = [Reply(text="no") if i < wrong else r for i, r in enumerate(right)]
    result = summarize(items, {"baseline": right, "candidate": candidate})
    assert result["drop_pp"] == pytest.approx(drop_pp)
    assert result["overall"]["delta_pp"] == pytest.approx(-drop_pp)
    assert result["verdict"] == expected


def test_failed_requests_leave_the_item_out_of_both_sides() -> None:
    items = exact_items(4)
    right = [Reply(text=item.answers[0]) for item in items]
    candidate = [Reply(error="HTTP 500: boom"), *right[1:]]
    result = summarize(items, {"baseline": right, "candidate": candidate})
    assert result["overall"]["items"] == 3
    assert result["verdict"] == NORMAL
    assert result["left_out"] == [{"id": "i0", "candidate": "HTTP 500: boom"}]


def test_every_request_failing_is_an_error() -> None:
    items = exact_items(2)
    failed = [Reply(error="refused")] * 2
    with pytest.raises(ValueError, match="every request failed.*refused"):
        summarize(items, {"baseline": failed, "candidate": failed})
