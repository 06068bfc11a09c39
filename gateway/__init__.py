"""gateway: the OpenAI HTTP API and the global scheduler behind it (FastAPI). Torch-free.

- Validation: `schemas.py` (a field it does not implement is a 400 naming it; the
  body's size and time limits), `limits.py` (every list and string field's), errors in
  OpenAI's shape (`errors.py`).
- CPU-heavy work off the event loop: `offload.py` (templates, tokenization),
  `template_sandbox.py` (request-supplied templates in killable children).
- Tenants and keys: `tenants.py` (the keys file, constant-time key lookup, the tenant's
  cache salt), `auth.py` (who may call which route), `rate_limits.py` (per-tenant
  requests, tokens and seats).
- The endpoints: `completions.py`, `chat.py`, the Responses API
  (`responses_request.py`: the body as a chat request; `responses_api.py`: the
  endpoint; `responses_output.py`: output items and OpenAI's events), prompts
  (`prompts.py`), sampling parameters (`sampling.py`), output constraints
  (`structured.py`: `response_format`,
  `structured_outputs`, `guided_*`, checked with `jsonschema`), tool calls
  (`tools.py`: forced calls as JSON schemas; `tool_parsers.py`: `hermes`,
  `llama3_json`), SSE and JSON replies (`replies.py`), tokenize/detokenize
  (`tokenization.py`), `/metrics` (`metrics.py`; `series.py`: each family named and
  registered; `frame_drop_metrics.py`: frames dropped by channel and reason;
  `deployment_metrics.py`: the TTFT SLO, seats and pool sizes the alert rules compare
  against), `/health`
  (`health.py`: each instance, and what degrades the service while it serves).
- One request on the cluster: `generation.py` (`GenerationRun`: its choices submitted,
  their tokens detokenized and stop strings matched on the event loop), readiness and
  the runs' admission (`gateway.py`: `Gateway`).
- The dispatcher between HTTP runs and instances (`dispatcher.py`, `request_stream.py`;
  `instance_frames.py`: its sealed frames, checked before they are decoded)
  and the global scheduler it drives (`global_scheduler.py`, `routing.py`: admission,
  routing policies, failover); a failed step's requests moved on
  (`step_failures.py`); instances' books asked for (`inspections.py`).
- Each request's timeline: `timeline.py` (a choice's journey as recorded, cut into
  phases on the gateway's clock), `clock_sync.py` (each instance's clock offset,
  bounded by messages), `timelines.py` (the live records, the latest runs kept, the
  phase histogram), `tracing.py` (each run as an OpenTelemetry trace over OTLP; the
  SDK loads only with `--otlp-traces-endpoint`), `trace_config.py` (what tracing
  accepts).
- Operators: `/admin/*` (`admin.py`: drain an instance, scale a pool, switch an
  instance's role, through the cluster's `PoolControl`; a request's timeline;
  `pool_changes.py`: the drains and switches both it and the SLO controller run, one
  claim per instance;
  `role_switch.py`: one switch carried out; `role_metrics.py`: its series), `/debug/*`
  (`debug.py`, mounted only with `--enable-test-hooks`).
- The SLO controller (`--autoscale slo`): `slo_controller.py` (each interval observes,
  asks the policy, vetoes or carries out one move), `slo_observation.py` (what it sees
  of the pools), `slo_samples.py` (TTFTs, gaps and arrivals in bounded memory),
  `controller_metrics.py` (its series), `controller_routes.py` (`/admin/controller`).
- The SLO policy (pure, clock-free): `slo_policy.py` (`SloPolicy.decide`: hold, switch,
  start or stop, with a reason), `slo_types.py` (its observation, forecast, decision and
  settings), `slo_forecast.py` (the next interval's load), `slo_split.py` (each split's
  TTFT and ITL from the planner's step-latency model).
"""
