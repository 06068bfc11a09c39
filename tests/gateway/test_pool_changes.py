"""The gateway's claims on instances: one change of an instance (a drain or a switch)
at a time, and a released instance may be claimed again."""

from __future__ import annotations

from pdserve.gateway.pool_changes import InstanceClaims


def test_one_change_of_an_instance_at_a_time() -> None:
    claims = InstanceClaims()
    assert claims.claim("decode-1") and claims.busy("decode-1")
    assert not claims.claim("decode-1")
    assert claims.claim("decode-0") and not claims.busy("prefill-0")
    claims.release("decode-1")
    assert not claims.busy("decode-1") and claims.busy("decode-0")
    assert claims.claim("decode-1")
