"""prefill: the prefill role.

- `role.py` (`PrefillRole`): admit with hand-off, first token out first, hold and hand
  off, release on the decode side's report;
- `kv_scheduler.py` (`PrefillKVScheduler`): its half of the KV connector, which builds
  each `KVHandoff` and its hold;
- `kv_server.py` (`PrefillKVServer`): the side of each rank's transfer I/O thread that
  serves pulls (holds, leases, sends the blocks' bytes: `PrefillKVServer._on_pull`).
"""
