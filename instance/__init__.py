"""instance: the instance process.

- `loop.py` (`StepLoop`): the step loop;
- `kinds.py`: the roles by name (a plain mapping), and `colocated.py`
  (`ColocatedRole`), the role that runs whole requests;
- `io.py`: the I/O thread, owner of every ZMQ socket, which heartbeats while a step
  runs;
- `spec.py` (`InstanceSpec`, carrying an `EngineConfig` and a `KVTransferConfig`) and
  `main.py`, the entry point;
- `reporting.py`: metric deltas shipped with the outputs;
- `hooks.py`: the test hooks, present only with `--enable-test-hooks`.
"""
