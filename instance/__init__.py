"""instance: the instance process.

- `loop.py` (`StepLoop`): the step loop; a failed step's requests go back to the
  gateway, `breaker.py` trips the circuit breaker on failed steps (the instance says it
  is unhealthy and is fenced), `probation.py` runs requests that failed a step
  elsewhere one at a time;
- `kinds.py`: the roles by name (a plain mapping), and `colocated.py`
  (`ColocatedRole`), the role that runs whole requests;
- `role_switch.py`: a role switch in place, once the old role holds nothing (weights,
  KV cache and process kept; the ranks' KV connectors serve and pull alike);
- `io.py`: the I/O thread, owner of every ZMQ socket, which heartbeats while a step
  runs and stamps each task's receipt (`Received`: where a request's queue starts);
  `task_epochs.py`: which of the gateway's tasks it takes by the epoch they name (a
  task for a retired epoch is dropped; across a role switch the old epoch is taken
  until the gateway names the new one);
- `spec.py` (`InstanceSpec`, carrying an `EngineConfig` and a `KVTransferConfig`) and
  `main.py`, the entry point;
- `reporting.py`: metric deltas shipped with the outputs;
- `hooks.py`: the test hooks, present only with `--enable-test-hooks`.
"""
