"""What an instance reports per step. The types live with the wire protocol in
`scheduler.messages` (torch-free, shared with the gateway); re-exported here."""

from scheduler.messages import RequestDelta, TokenLogprobs

__all__ = ["RequestDelta", "TokenLogprobs"]
