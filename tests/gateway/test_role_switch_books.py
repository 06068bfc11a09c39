"""The gateway's books of a role switch: an instance moves to its new pool only with
an output in the epoch after its current one (never while dead, never twice), routable
again with its prefix-cache mirror kept; what it sent in its old epoch counts no more;
`/metrics` shows one role per instance and counts the switches."""

from __future__ import annotations

import msgspec

from pdserve.common.messages import InstanceAddress
from pdserve.gateway.global_scheduler import GlobalScheduler
from pdserve.gateway.metrics import GatewayMetrics
from tests.gateway.instances import instance_info


def as_role(instance_id: str, role: str, epoch: int):
    info = instance_info(instance_id, role)
    address = InstanceAddress(instance_id, role, info.address.task_address)
    return msgspec.structs.replace(info, address=address, epoch=epoch)


def test_an_instance_moves_pools_in_its_next_epoch_only() -> None:
    scheduler = GlobalScheduler()
    scheduler.add_instance(instance_info("prefill-0", "prefill"), now=0.0)
    view = scheduler.add_instance(instance_info("decode-0", "decode"), now=0.0)
    scheduler.add_instance(instance_info("decode-1", "decode"), now=0.0)
    mirror = view.mirror
    scheduler.drain("decode-0")
    assert scheduler.switch_role(as_role("decode-0", "prefill", 2), now=1.0) is None  # skips one
    assert scheduler.switch_role(as_role("decode-0", "prefill", 1), now=1.0) == "decode"
    assert (view.role, view.epoch, view.draining, view.mirror) == ("prefill", 1, False, mirror)
    assert view in scheduler.live(["prefill"]) and view not in scheduler.live(["decode"])
    assert scheduler.switch_role(as_role("decode-0", "prefill", 1), now=2.0) is None  # once
    assert not scheduler.observe("decode-0", None, now=3.0, epoch=0)  # the old epoch's
    assert scheduler.observe("decode-0", None, now=3.0, epoch=1)
    scheduler.mark_dead("decode-0")
    assert scheduler.switch_role(as_role("decode-0", "decode", 3), now=4.0) is None


def test_metrics_show_one_role_per_instance_and_count_switches() -> None:
    metrics = GatewayMetrics()
    metrics.add_instance("decode", "decode-1")
    metrics.move_instance("decode", "prefill", "decode-1")
    metrics.roles.record_switch("decode", "prefill", 0.4)
    text = metrics.render().decode()
    assert 'pdserve:instance_role{instance="decode-1",role="prefill"} 1.0' in text
    assert 'pdserve:instance_role{instance="decode-1",role="decode"}' not in text
    assert 'pdserve:instance_up{instance="decode-1",role="prefill"} 1.0' in text
    assert 'pdserve:instance_up{instance="decode-1",role="decode"}' not in text
    assert 'pdserve:role_switches_total{from="decode",to="prefill"} 1.0' in text
    assert "pdserve:role_switch_seconds_count 1.0" in text
    metrics.roles.forget("decode-1")  # drained and stopped
    assert "pdserve:instance_role{" not in metrics.render().decode()


def test_an_instances_settings_move_with_it_to_its_new_role() -> None:
    metrics = GatewayMetrics()
    metrics.add_instance("decode", "decode-1")
    metrics.deployment.set_max_num_seqs("decode", "decode-1", 8)
    metrics.deployment.set_kv_cache("decode", "decode-1", "float8_e4m3fn", 1024)
    metrics.move_instance("decode", "prefill", "decode-1")
    text = metrics.render().decode()
    assert 'pdserve:max_num_seqs{instance="decode-1",role="prefill"} 8.0' in text
    assert 'pdserve:max_num_seqs{instance="decode-1",role="decode"}' not in text
    moved = 'pdserve:kv_cache_bytes_per_token{instance="decode-1",kv_cache_dtype="float8_e4m3fn",'
    assert moved + 'role="prefill"} 1024.0' in text
    assert moved + 'role="decode"}' not in text
