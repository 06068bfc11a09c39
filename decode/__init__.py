"""decode: the decode role.

- `role.py` (`DecodeRole`): take handoffs, pull what the local prefix cache lacks,
  decode, and apply the failure policy of a pull;
- `pull_outcomes.py`: how the latest pulls ended (recomputed or not), into the
  instance's stats; `pending.py`: handoffs on their way, voided by an abort;
- `kv_scheduler.py` (`DecodeKVScheduler`): its half of the KV connector;
- `kv_puller.py` (`DecodeKVPuller`): the side of each rank's transfer I/O thread that
  pulls (handshakes, receives straight into the KV blocks, heartbeats, deadlines; each
  pull timed for the request's timeline), with
  its state in `pull_state.py`.
"""
