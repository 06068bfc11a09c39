"""Instances as they register with the global scheduler, for its tests and the routing
policies'."""

from __future__ import annotations

from pdserve.common.messages import InstanceAddress, InstanceInfo

BLOCK = 4


def instance_info(
    instance_id: str,
    role: str = "prefill",
    blocks: int = 100,
    max_num_seqs: int = 8,
    tasks_address: str = "tcp://127.0.0.1:1",
    events_address: str = "tcp://127.0.0.1:2",
) -> InstanceInfo:
    """Only the id, role, block count and seats matter to routing; the addresses (real
    sockets' where a test serves them) and the model's limits are placeholders."""
    return InstanceInfo(
        address=InstanceAddress(instance_id, role, tasks_address),
        events_address=events_address,
        model_path="m",
        max_model_len=4096,
        vocab_size=1000,
        block_size=BLOCK,
        num_blocks=blocks,
        max_num_seqs=max_num_seqs,
    )
