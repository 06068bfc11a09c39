"""What the HTTP handlers share: tokenizer, model card, dispatcher, metrics, settings."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdserve.common.messages import InstanceInfo
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire_auth import salt_key
from pdserve.gateway.deployment_metrics import PoolCount
from pdserve.gateway.dispatcher import Dispatcher
from pdserve.gateway.errors import APIError, error_body
from pdserve.gateway.generation import Choice, GenerationFailed, GenerationRun
from pdserve.gateway.global_scheduler import (
    AdmissionRejected,
    GlobalScheduler,
    GlobalSchedulerConfig,
)
from pdserve.gateway.health import health_body
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.offload import DEFAULT_BUDGET_S, Offload
from pdserve.gateway.pool_changes import InstanceClaims
from pdserve.gateway.prompts import Prompt
from pdserve.gateway.rate_limits import RateLimited, RateLimiter
from pdserve.gateway.routing import ROLES_THAT_DECODE
from pdserve.gateway.slo_controller import AutoscaleConfig, SloController
from pdserve.gateway.slo_policy import SloPolicy
from pdserve.gateway.slo_samples import SloSamples
from pdserve.gateway.streaming import ClientDisconnected, watch_disconnect
from pdserve.gateway.tenants import (
    ANONYMOUS,
    KeyBook,
    KeysFile,
    Tenant,
    TenantsError,
    tenant_cache_salt,
)
from pdserve.gateway.timelines import Timelines, TraceHeaders
from pdserve.gateway.tool_parsers import PARSERS, ToolParser
from pdserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pdserve.gateway.admin import PoolControl

logger = logging.getLogger(__name__)

POOL_ROLES = ("prefill", "decode", "colocated")
CLIENT_CLOSED_REQUEST = 499  # nginx's code: nobody reads it, but logs show it


@dataclass(frozen=True)
class GatewayConfig:
    model_path: str  # the checkpoint folder (its tokenizer is loaded here)
    served_model_names: list[str]
    max_model_len: int | None = None  # a cap below the instances' own
    api_key: str | None = field(default=None, repr=False)  # one key: tenant "default"
    enable_test_hooks: bool = False
    zmq_host: str = "127.0.0.1"  # where the output PULL socket binds
    scheduler: GlobalSchedulerConfig = field(default_factory=GlobalSchedulerConfig)
    # Instances the launch brings up: not ready until all have registered, so a client
    # or load balancer that waits on /health meets the whole deployment (0: no wait).
    expected_instances: int = 0
    tokenizer_path: str | None = None  # a tokenizer folder other than the model's
    chat_template: str | None = None  # replaces the tokenizer's own templates
    # tool_choice "auto": which parser finds calls in the model's text (None: refused)
    tool_call_parser: str | None = None
    # JSON constraints: compact separators instead of free whitespace (vLLM's
    # --structured-outputs-config disable_any_whitespace; a request may say otherwise)
    disable_any_whitespace: bool = False
    # Hostile input (docs/security.md): request-supplied chat templates are refused
    # unless trusted; prompts and completions are logged only when asked for.
    trust_request_chat_template: bool = False
    enable_log_requests: bool = False
    cpu_budget_s: float = DEFAULT_BUDGET_S  # rendering or tokenizing one request's prompt
    # Tenants (docs/security.md): a keys file instead of `api_key`, the operators' key,
    # /metrics without a key, and the secret of every cache salt (None: random, so
    # salts differ between runs; secrets stay out of any repr).
    api_keys: KeysFile | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    metrics_public: bool = False
    deployment_secret: bytes | None = field(default=None, repr=False)
    request_timeout_s: float = 0.0  # a request's deadline from arrival to its end (0: none)
    # The time-to-first-token objective, exported for alert rules (None: none set).
    ttft_slo_ms: float | None = None
    # Where each request's trace goes (OTLP; None: no traces) and which detail it gets
    # (vLLM's --collect-detailed-traces modules; docs/operations.md).
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: tuple[str, ...] = ()
    # `--autoscale slo`: the SLO controller's policy settings and latency model (None: off).
    autoscale: AutoscaleConfig | None = None


@dataclass(frozen=True)
class ModelCard:
    """What the instances reported about the model they serve."""

    max_model_len: int
    vocab_size: int
    generation_defaults: dict[str, int | float]


class Gateway:
    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what the per-tenant limits measure minutes with."""
        if not config.served_model_names:
            raise ValueError("at least one served model name is needed")
        self.config = config
        try:
            self.keys = KeyBook.build(
                config.served_model_names, config.api_keys, config.api_key, config.admin_api_key
            )
        except TenantsError as exc:
            raise ValueError(str(exc)) from None
        self.limiter = RateLimiter(clock)
        # Cache salts take a key of their own, derived from the secret (never the
        # frames' key).
        self._salt_key = salt_key(config.deployment_secret or secrets.token_bytes(32))
        self.tokenizer = Tokenizer.from_folder(config.tokenizer_path or config.model_path)
        if config.chat_template is not None:
            self.tokenizer.chat_templates = {"default": config.chat_template}
        parser = PARSERS.get(config.tool_call_parser or "")
        if config.tool_call_parser is not None and parser is None:
            raise ValueError(
                f"unknown tool call parser {config.tool_call_parser!r}; "
                f"choose one of {', '.join(PARSERS)}"
            )
        self.tool_parser: ToolParser | None = parser() if parser is not None else None
        self.offload = Offload(self.tokenizer, config.cpu_budget_s)
        self.metrics = GatewayMetrics(self.model_name)  # the model_name label of vllm:*
        for tenant in self.keys.tenants or (ANONYMOUS,):
            self.metrics.tenants.add(tenant.name)
        self.scheduler = GlobalScheduler(config.scheduler)
        observe = self.metrics.request_phase.labels  # the phase histogram, by phase
        timelines = Timelines(self.model_name, lambda phase, s: observe(phase).observe(s))
        if config.otlp_traces_endpoint is not None:  # the SDK loads only when asked for
            from pdserve.gateway.tracing import TraceExporter

            timelines.exporter = TraceExporter.to_endpoint(
                config.otlp_traces_endpoint, config.collect_detailed_traces
            )
        self.dispatcher = Dispatcher(
            self.scheduler, self.metrics, config.zmq_host, timelines=timelines
        )
        if config.ttft_slo_ms is not None:
            self.metrics.deployment.set_ttft_slo(config.ttft_slo_ms / 1000.0)
        self.metrics.deployment.watch_pools(self.pool_counts)
        self.model_card: ModelCard | None = None
        # Starts and stops instances for /admin/* (set by `pdserve serve`; None: cannot).
        self.pools: PoolControl | None = None
        self.claims = InstanceClaims()  # the instances a drain or a switch holds
        self._registered: set[str] = set()  # ids, so a restart is not counted twice
        self.slo_samples = SloSamples()  # what the runs tell the SLO controller
        self.controller: SloController | None = None
        if config.autoscale is not None:
            policy = SloPolicy(config.autoscale.policy, config.autoscale.calibration)
            self.controller = SloController(self, policy, config.autoscale.policy)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    @property
    def output_address(self) -> str:
        return self.dispatcher.output_address

    # ---- lifecycle (event loop thread) ------------------------------------------------

    def start(self) -> None:
        self.dispatcher.start()
        if self.controller is not None:
            self.controller.start()

    async def close(self) -> None:
        if self.controller is not None:
            await self.controller.close()
        await self.dispatcher.close()
        self.dispatcher.timelines.close()  # exports the spans still queued
        self.offload.close()

    def register(self, info: InstanceInfo) -> None:
        limit = info.max_model_len
        if self.config.max_model_len:
            limit = min(limit, self.config.max_model_len)
        if self.model_card is not None:
            limit = min(limit, self.model_card.max_model_len)
        self.model_card = ModelCard(limit, info.vocab_size, dict(info.generation_defaults))
        self.dispatcher.register(info)
        self._registered.add(info.address.instance_id)
        self.metrics.deployment.set_max_num_seqs(
            info.address.role, info.address.instance_id, info.max_num_seqs
        )
        if info.kv_cache_dtype:
            self.metrics.deployment.set_kv_cache(
                info.address.role,
                info.address.instance_id,
                info.kv_cache_dtype,
                info.kv_bytes_per_token,
            )

    def instance_lost(self, instance_id: str, reason: str) -> None:
        self.dispatcher.instance_lost(instance_id, reason)

    def pool_counts(self) -> dict[str, PoolCount]:
        """Each pool's size and how many of its instances are alive (none without a
        cluster that keeps pools: a bare gateway knows no size to fall short of)."""
        if self.pools is None:
            return {}
        counts: dict[str, PoolCount] = {}
        for role in POOL_ROLES:
            members = self.pools.members(role)
            if members:
                views = (self.scheduler.views.get(i) for i in members)
                up = sum(1 for view in views if view is not None and view.alive)
                counts[role] = PoolCount(len(members), up)
        return counts

    def ready(self) -> bool:
        """Whether a request can be finished: startup is over and a decode or colocated
        instance is alive (a prefill pool alone hands off to nobody)."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        expected = self.config.expected_instances
        if len(self._registered) < expected:
            return f"starting: {len(self._registered)}/{expected} instances ready"
        if not self.scheduler.live(ROLES_THAT_DECODE):
            return "no decode or colocated instance is ready"
        return None

    def require_ready(self) -> None:
        """503 with Retry-After while `ready()` is false (/health, /v1/models)."""
        reason = self.not_ready_reason()
        if reason is not None:
            raise APIError(503, reason, code="unavailable", headers={"Retry-After": "1"})

    def health(self) -> dict[str, Any]:
        """/health's body: each instance as the scheduler sees it, and what degrades the
        service while it serves (`gateway/health.py`)."""
        return health_body(self.scheduler.views.values())

    # ---- request helpers --------------------------------------------------------------

    def models_of(self, tenant: Tenant) -> list[str]:
        return [name for name in self.config.served_model_names if tenant.may_use(name)]

    def check_model(self, name: str | None, tenant: Tenant = ANONYMOUS) -> str:
        """The served name a request asks for (the tenant's first when it names none);
        404 for a name not served or not the tenant's, as OpenAI words it."""
        allowed = self.models_of(tenant)
        if name is None and allowed:
            return allowed[0]
        if name in allowed:
            return name
        raise APIError(
            404,
            f"The model `{name}` does not exist or you do not have access to it.",
            "model",
            "model_not_found",
        )

    def require_model_card(self) -> ModelCard:
        if self.model_card is None:
            raise APIError(
                503, "no instance is ready yet", code="unavailable", headers={"Retry-After": "1"}
            )
        return self.model_card

    def check_rate(self, tenant: Tenant) -> None:
        """429 if the tenant is over a limit whatever the request: called before the
        prompt costs any CPU."""
        try:
            self.limiter.check(tenant)
        except RateLimited as exc:
            self.metrics.tenants.rate_limited(tenant.name)
            raise exc.api_error() from None

    def admit(self, name: str | None, tenant: Tenant) -> tuple[str, ModelCard]:
        """The served name a generation asks for and the model card it runs against, once
        the tenant is within its rate limits: before the prompt costs any CPU."""
        model = self.check_model(name, tenant)
        self.check_rate(tenant)
        return model, self.require_model_card()

    def start_run(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        tenant: Tenant = ANONYMOUS,
        cache_salt: str | None = None,
        received: float | None = None,
        trace: TraceHeaders = TraceHeaders(),
    ) -> GenerationRun:
        """Admits the run against the tenant's limits (429) and the cluster's (503);
        `received`, `trace`: where its timeline starts and the client's trace context."""
        reserved = sum(len(p.token_ids) for p in prompts)
        reserved += len(prompts) * params.n * (params.max_tokens or 0)
        try:
            ticket = self.limiter.admit(tenant, reserved)
        except RateLimited as exc:
            self.metrics.tenants.rate_limited(tenant.name)
            raise exc.api_error() from None
        except ValueError as exc:  # can never fit: retrying would not help, so no 429
            raise APIError(400, str(exc), "max_tokens", "request_too_large") from None

        def on_end(usage: dict[str, int]) -> None:
            self.limiter.release(ticket, usage["total_tokens"])
            self.metrics.tenants.used(tenant.name, usage)

        salt = tenant_cache_salt(self._salt_key, tenant.name, cache_salt)
        run = GenerationRun(
            request_id=request_id,
            prompts=prompts,
            params=params,
            dispatcher=self.dispatcher,
            tokenizer=self.tokenizer,
            metrics=self.metrics,
            cache_salt=salt,
            on_end=on_end,
            timeout_s=self.config.request_timeout_s,
            received=received,
            trace=trace,
            samples=self.slo_samples,
        )
        try:
            run.start()
        except AdmissionRejected as exc:
            run.abort()  # gives the tenant's seat and tokens back
            self.metrics.rejected.inc()
            raise APIError(
                503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)}
            ) from None
        self.metrics.tenants.admitted(tenant.name)
        self._count_arrivals(prompts, params)
        return run

    def _count_arrivals(self, prompts: list[Prompt], params: SamplingParams) -> None:
        """Each admitted choice, for the SLO controller's forecast: its prompt and its
        output bound (max_tokens, else the context the prompt leaves)."""
        context = self.model_card.max_model_len if self.model_card is not None else 0
        for prompt in prompts:
            length = len(prompt.token_ids)
            bound = params.max_tokens or max(0, context - length)
            for _ in range(params.n):
                self.slo_samples.add_arrival(length, bound)

    async def finish_run(self, request: Request, run: GenerationRun) -> list[Choice]:
        """Waits for every choice; aborts them all if the client leaves or one fails."""
        try:
            return await watch_disconnect(request, run.wait())
        except ClientDisconnected:
            raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request") from None
        except GenerationFailed as exc:
            if exc.rejected:
                raise APIError(400, str(exc)) from None
            if exc.timed_out:
                raise APIError(504, str(exc), code="request_timeout") from None
            raise APIError(503, str(exc), code="instance_failed") from None
        finally:
            if not run.finished:
                run.abort()

    def stream_error(self, exc: BaseException) -> dict[str, Any]:
        """The SSE error event for a failure after the stream began."""
        if isinstance(exc, GenerationFailed):
            if exc.timed_out:
                return error_body(504, str(exc), code="request_timeout")
            return error_body(400 if exc.rejected else 503, str(exc))
        logger.exception("a stream failed", exc_info=exc)
        return error_body(500, f"internal error: {type(exc).__name__}")

    @staticmethod
    def json(payload: Any, status: int = 200) -> Response:
        return Response(msgspec.json.encode(payload), status, media_type="application/json")
