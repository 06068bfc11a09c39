"""Which of the gateway's tasks an instance takes by the epoch they name
(instance/task_epochs.py): its own epoch only, and across a role switch the epoch it
left until the gateway names the new one."""

from __future__ import annotations

from pdserve.instance.task_epochs import TaskEpochs


def test_only_the_current_epoch_is_taken_after_a_start_or_restart() -> None:
    epochs = TaskEpochs(4)  # a replacement: epochs 0..3 were retired
    assert epochs.admit(4)
    assert not epochs.admit(3)  # sent to the fenced predecessor
    assert not epochs.admit(5)  # meant for a successor of this process
    assert epochs.current == 4


def test_a_role_switch_keeps_the_old_epoch_open_until_the_new_one_is_named() -> None:
    epochs = TaskEpochs(2)
    epochs.switch(3)
    assert epochs.current == 3
    # Sent after the switch task, before the gateway heard the switch: still taken.
    assert epochs.admit(2) and epochs.admit(2)
    assert epochs.admit(3)  # the gateway knows the new epoch now
    assert not epochs.admit(2)  # the gateway's socket keeps order: this one is stale
    assert not epochs.admit(1)


def test_a_second_switch_leaves_only_the_epoch_just_left_open() -> None:
    epochs = TaskEpochs(0)
    epochs.switch(1)
    epochs.switch(2)  # switched again before any task named 1
    assert epochs.admit(1) and not epochs.admit(0)
    assert epochs.admit(2) and not epochs.admit(1)
