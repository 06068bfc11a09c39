"""cluster: bringing it up. Ray lives here only.

- `pdserve serve`: `serve.py`, `serve_cli.py` (its flags; `ops_flags.py`: the tracing
  and debugging ones and their checks; `autoscale_flags.py`: the SLO controller's,
  checked into its typed config; `help_format.py`: defaults in
  `--help` as vLLM shows them), `exposure.py` (beyond loopback only with tenant and
  admin keys, or `--allow-unauthenticated`), `deployment.py` (`Deployment`: what the
  flags bring up, the engine and KV transfer configs built from them by attribute),
  `http_server.py` (uvicorn's settings and the request-head timeout);
- placement on cores and GPUs (`placement.py`), where sockets bind (`addresses.py`),
  a joined Ray cluster's inventory (`ray_cluster.py`);
- the launchers (`launcher.py`): the Ray launcher (`ray_launcher.py`, `ray_actors.py`:
  role-neutral `Instance` actors (a role can change in place) and, for
  `--mode colocated`, `ColocatedInstance`, with the pools' custom resources; a
  tensor-parallel instance's ranks as `TensorParallelRank` actors in its placement
  groups, `ray_ranks.py`; the secret handed to actors as a file on their node,
  `secret_file.py`, in the actors' `runtime_env` with Ray's worker niceness at 0,
  `actor_env.py`) and the Ray-free local launcher
  (`local_launcher.py`: processes titled `pdserve::DecodeInstance decode-0`);
- `supervisor.py`: restarts an instance whose process exited and kills a fenced one;
  `ray_watch.py`: the Ray launcher's actors after the launch (the death watch over
  `load()` and `run()` calls; one actor started, stopped or killed);
- `pools.py`: the pools' control for `/admin/*` (members, the `--max-pool-size` cap,
  more started a few at a time in the background, one drained stopped, whether an
  instance fits another pool for a role switch, one change of an instance at a time).
"""
