"""`check_int8_groups`: int8 scale groups fit every matrix's rows and every rank's slice
of the row-parallel ones, or the split is refused in one line naming the width."""

from __future__ import annotations

import pytest

from pdserve.common.model_split import INT8_GROUP_SIZE, Int8GroupError, check_int8_groups

# The embedded model (SmolLM2-135M): hidden 576, 9 heads x 64, MLP 1536.
HIDDEN, ATTENTION, MLP = 576, 576, 1536


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_the_embedded_models_splits_keep_whole_groups(tp: int) -> None:
    assert INT8_GROUP_SIZE == 16
    check_int8_groups(tp, HIDDEN, ATTENTION, MLP)


def test_a_rank_slice_that_cuts_a_group_is_refused_in_one_line() -> None:
    with pytest.raises(Int8GroupError) as refused:
        check_int8_groups(8, HIDDEN, ATTENTION, MLP)
    assert str(refused.value) == (
        "--quantization int8 keeps one scale per 16 inputs, which does not divide the model's "
        "attention output's input width 576 / tensor parallel size 8 = 72"
    )
    cut = "intermediate size 1536 / tensor parallel size 4 = 384"
    with pytest.raises(Int8GroupError, match=cut):
        check_int8_groups(4, 1024, 1024, MLP, group_size=256)


def test_a_hidden_size_the_groups_do_not_divide_is_refused() -> None:
    with pytest.raises(Int8GroupError, match="does not divide the model's hidden size 40$"):
        check_int8_groups(1, 40, 96, 192)
