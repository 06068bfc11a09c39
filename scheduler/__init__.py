"""scheduler: who computes what, when, on one instance. Pure Python.

- `step_scheduler.py` (`Scheduler`): the token budget, continuous batching, chunked
  prefill and preemption; on a prefill instance a request added with `hand_off=True`
  becomes HANDED_OFF after its first token (`Scheduler._hold`), its blocks held for
  the decode side; on a decode instance `add_remote_request` waits in
  WAITING_FOR_REMOTE_KVS until `finish_remote_kvs`;
- `prefix_order.py`: the `lpm` admission order (longest cached prefix first, waiting
  for blocks a running request is computing);
- `admission.py`: whether a request can ever fit; `remote_kv.py`: the decode side's
  admission of a remote request and end of its pull; `stop_checker.py`: stops on token
  ids and lengths;
- the block manager (`block_manager.py`, `block_pool.py`): paged blocks and the prefix
  cache, keyed by `block_hash.py`'s hashes; `outputs.py`: what a step schedules;
  `scheduler_checks.py`: the books' invariants.
"""
