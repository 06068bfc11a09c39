"""What `pdserve serve` brings up, worked out from its flags before anything starts.

The instances (roles, ids, threads and cores), the engine arguments they share and the
gateway's settings. Every flag problem surfaces here as one `ServeError` line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field

from pdserve.cluster.autoscale_flags import AutoscaleConfig, autoscale_config
from pdserve.cluster.ops_flags import check_tracing_flags, detail_modules
from pdserve.cluster.parallel_sizes import ParallelSizeError, tensor_parallel_sizes
from pdserve.cluster.placement import (
    PlacementError,
    PlannedInstance,
    available_cores,
    available_gpus,
    place,
    place_on_gpus,
    pool_capacity,
    resolve_device,
)
from pdserve.common.named_values import named_values
from pdserve.engine.checkpoint import CheckpointError
from pdserve.engine.config import EngineConfig
from pdserve.engine.embedded import MODEL_NAME
from pdserve.engine.gguf_prepare import gguf_source
from pdserve.engine.model_source import ModelNotFound
from pdserve.engine.model_source import resolve_model as resolve_model_source
from pdserve.gateway.global_scheduler import GlobalSchedulerConfig
from pdserve.gateway.tenants import KeyBook, KeysFile, TenantsError, read_keys_file
from pdserve.gateway.trace_config import collects_model
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.text.tokenizer import TokenizerError, read_chat_template

MODES = ("disaggregated", "colocated")
LAUNCHERS = ("ray", "local")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class ServeError(ValueError):
    """A flag combination that cannot be served; the message is one line."""


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "512MiB", "1.5GB", "4096" (binary units with an i)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ServeError(f"cannot read {text!r} as a size (examples: 2GiB, 512MiB, 1073741824)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower().rstrip("b")
    if unit.endswith("i"):
        scale = 1024 ** "kmgt".index(unit[0]) * 1024
    else:
        scale = _UNITS[unit]
    size = int(number * scale)
    if size <= 0:
        raise ServeError(f"size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class Deployment:
    args: argparse.Namespace
    model_path: str | None  # None: the embedded model (resolved at start)
    served_model_names: list[str]
    instances: list[PlannedInstance]
    engine: EngineConfig  # what every instance shares (instance_specs adds its own)
    scheduler: GlobalSchedulerConfig
    # The prefill and decode instances' (None: colocated); each spec gets its own id.
    kv_transfer: KVTransferConfig | None
    chat_template: str | None = None  # --chat-template's text
    api_key: str | None = field(default=None, repr=False)  # --api-key or PDSERVE_API_KEY
    api_keys: KeysFile | None = field(default=None, repr=False)  # --api-keys-file
    admin_api_key: str | None = field(default=None, repr=False)  # or PDSERVE_ADMIN_API_KEY
    # Ranks per instance, by role (--tensor-parallel-size and the per-pool overrides).
    tensor_parallel: dict[str, int] = field(default_factory=dict)
    # Ray custom resources per instance actor, by role (--prefill-resources, ...)
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    # The most instances `/admin/pools/{role}/scale` may ask for, by role.
    max_pool_sizes: dict[str, int] = field(default_factory=dict)
    autoscale: AutoscaleConfig | None = None  # --autoscale slo's controller (None: off)

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        cores: list[int] | None = None,
        gpus: list[str] | None = None,
    ) -> Deployment:
        """`cores` and `gpus` default to what this machine has (a joined Ray cluster's
        inventory comes in through them: `cluster/ray_cluster.py`)."""
        resolve_model(args)
        check_flags(args)
        resources = ray_resources(args)
        cores = cores or available_cores()
        instances = place(_roles(args), cores, args.threads_per_instance)
        gpus = available_gpus() if gpus is None else gpus
        names = args.served_model_name or [args.model or MODEL_NAME]
        model_path = local_model(args)
        try:
            device = resolve_device(args.device, gpus)
        except PlacementError as exc:
            raise ServeError(str(exc)) from None
        if device == "cuda" and model_path is not None and gguf_source(model_path):
            raise ServeError(f"{args.model}: GGUF weights are served on CPU, not on cuda")
        try:
            tensor_parallel = tensor_parallel_sizes(args, model_path, device)
        except ParallelSizeError as exc:
            raise ServeError(str(exc)) from None
        ranks = {role: tp * args.pipeline_parallel_size for role, tp in tensor_parallel.items()}
        try:
            if device == "cuda":
                instances = place_on_gpus(instances, gpus, args.gpu_memory_utilization, ranks)
        except PlacementError as exc:
            raise ServeError(str(exc)) from None
        engine = engine_config(args, model_path, device)
        max_pool_sizes = pool_limits(args, instances, len(cores), len(gpus))
        try:
            scheduler = GlobalSchedulerConfig(
                routing_policy=args.routing_policy,
                max_queued_requests=args.max_queued_requests,
                instance_timeout_s=args.instance_timeout,
                instance_stall_timeout_s=args.instance_stall_timeout,
                max_attempts=args.max_request_retries + 1,
                skip_prefill_max_tokens=args.skip_prefill_max_tokens,
                skip_prefill_min_cached_ratio=args.skip_prefill_min_cached_ratio,
            )
            autoscale = autoscale_config(args, instances, max_pool_sizes)
        except ValueError as exc:
            raise ServeError(str(exc)) from None
        kv_transfer = kv_transfer_config(args) if args.mode == "disaggregated" else None
        chat_template = None
        try:
            if args.chat_template is not None:
                chat_template = read_chat_template(args.chat_template)
        except TokenizerError as exc:
            raise ServeError(f"--chat-template: {exc}") from None
        if args.tokenizer is not None and not os.path.isdir(os.path.expanduser(args.tokenizer)):
            raise ServeError(f"--tokenizer {args.tokenizer}: no such tokenizer folder")
        api_key, api_keys, admin_api_key = api_keys_of(args, names)
        return cls(
            args=args,
            model_path=model_path,
            served_model_names=names,
            instances=instances,
            engine=engine,
            scheduler=scheduler,
            kv_transfer=kv_transfer,
            chat_template=chat_template,
            api_key=api_key,
            api_keys=api_keys,
            admin_api_key=admin_api_key,
            tensor_parallel=tensor_parallel,
            resources=resources,
            max_pool_sizes=max_pool_sizes,
            autoscale=autoscale,
        )


def pool_limits(
    args: argparse.Namespace, instances: list[PlannedInstance], num_cores: int, num_gpus: int
) -> dict[str, int]:
    """`--max-pool-size` for every pool, or what the cores and GPUs hold of each role's
    instances (`pool_capacity`); never below a pool's planned size."""
    capacity = pool_capacity(instances, num_cores, num_gpus)
    if args.max_pool_size is None:
        return capacity
    planned = {role: sum(i.role == role for i in instances) for role in capacity}
    for role, count in planned.items():
        if args.max_pool_size < count:
            raise ServeError(
                f"--max-pool-size {args.max_pool_size} is below the {count} {role} "
                "instances planned"
            )
    return dict.fromkeys(capacity, args.max_pool_size)


def api_keys_of(
    args: argparse.Namespace, served: list[str]
) -> tuple[str | None, KeysFile | None, str | None]:
    """The single key (--api-key, else PDSERVE_API_KEY) or the keys file, and the admin
    key (--admin-api-key, else PDSERVE_ADMIN_API_KEY): checked now, so a bad file is
    one line at startup, not an error once instances have loaded."""
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    admin_key = args.admin_api_key or os.environ.get("PDSERVE_ADMIN_API_KEY") or None
    try:
        api_keys = read_keys_file(args.api_keys_file) if args.api_keys_file else None
        KeyBook.build(served, api_keys, api_key, admin_key)
    except TenantsError as exc:
        raise ServeError(str(exc)) from None
    return api_key, api_keys, admin_key


def ray_resources(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """--prefill-resources, --decode-resources, --colocated-resources: each a JSON object
    of Ray custom resources (name -> positive amount) every instance of the role asks
    for."""
    resources = {}
    for role in ("prefill", "decode", "colocated"):
        flag = f"--{role}-resources"
        text = getattr(args, f"{role}_resources", None)
        if text is None:
            continue
        if args.launcher != "ray":
            raise ServeError(f"{flag} places Ray actors; it needs --launcher ray")
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ServeError(f"{flag}: not JSON ({exc.msg}); e.g. '{{\"node_a\": 1}}'") from None
        if not isinstance(parsed, dict) or not all(
            isinstance(k, str)
            and k
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and v > 0
            for k, v in parsed.items()
        ):
            raise ServeError(f"{flag}: want an object of resource names to positive amounts")
        reserved = {"CPU", "GPU", "memory", "object_store_memory"} & set(parsed)
        if reserved:
            raise ServeError(f"{flag}: {', '.join(sorted(reserved))} is set by pdserve itself")
        resources[role] = {k: float(v) for k, v in parsed.items()}
    return resources


# The EngineConfig fields every instance shares that a flag of the same name sets as is
# (the rest are read from the checkpoint, parsed, or differ per instance).
SHARED_ENGINE_FLAGS = (
    *("dtype", "quantization", "kv_cache_dtype", "calculate_kv_scales", "tokenizer"),
    *("generation_config", "seed"),
    *("max_num_seqs", "max_num_batched_tokens", "max_model_len"),  # scheduling
    *("enable_prefix_caching", "pipeline_parallel_size", "enforce_eager"),
    "scheduling_policy",
)


def engine_config(args: argparse.Namespace, model_path: str | None, device: str) -> EngineConfig:
    """The engine settings every instance shares, from the flags by name."""
    try:
        return EngineConfig(
            model=model_path,
            kv_cache_memory=parse_size(args.kv_cache_memory),
            device=device,
            block_size=args.block_size or 0,  # None: the device's (default_block_size)
            **named_values(args, SHARED_ENGINE_FLAGS),
            collect_model_time=collects_model(detail_modules(args)),
        )
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """The KV transfer limits, derived from the lease so they stay consistent: pulls
    give up before the lease ends, heartbeats renew it several times over. Each
    instance's spec carries it under its own id (`instance_specs`)."""
    lease = args.kv_lease_seconds
    timeout = args.kv_transfer_timeout or min(10.0, lease / 2)
    try:
        return KVTransferConfig(
            instance_id="deployment",
            transport=args.kv_transport,
            failure_policy=args.kv_failure_policy,
            lease_s=lease,
            transfer_timeout_s=timeout,
            heartbeat_interval_s=min(2.0, lease / 4),
            handshake_timeout_s=min(5.0, timeout),
        )
    except ValueError as exc:
        raise ServeError(f"--kv-lease-seconds / --kv-transfer-timeout: {exc}") from None


def resolve_model(args: argparse.Namespace) -> None:
    """`pdserve serve MODEL` (as `vllm serve MODEL`) and `--model MODEL` are one setting:
    the positional one lands in `args.model`, which everything downstream reads."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and _real(args.model) != _real(tag):
        raise ServeError(f"two models given: {tag} and --model {args.model}; give one of them")
    args.model = tag


def local_model(args: argparse.Namespace) -> str | None:
    """The folder of `--model`: as given, or a Hugging Face id resolved from the hub cache
    (the served name stays the id, as in vLLM); None: the embedded model."""
    if args.model is None:
        return None
    try:
        folder = resolve_model_source(args.model, args.revision, args.download_dir)
        source = gguf_source(folder)  # a GGUF file is checked here
    except (ModelNotFound, CheckpointError) as exc:
        raise ServeError(f"--model {exc}") from None
    if source is not None and args.quantization is not None:
        raise ServeError(
            f"--quantization {args.quantization} applies to 16/32-bit checkpoints; "
            f"{args.model} is served in its own GGUF blocks"
        )
    return str(folder)


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def check_flags(args: argparse.Namespace) -> None:
    positive = ("max_num_seqs", "max_num_batched_tokens", "block_size")
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ServeError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ServeError("--max-model-len must be at least 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ServeError("--gpu-memory-utilization must be in (0, 1]")
    for name in ("num_prefill", "num_decode"):
        if getattr(args, name) < 1:
            raise ServeError(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_colocated is not None and args.num_colocated < 1:
        raise ServeError("--num-colocated must be at least 1")
    if args.threads_per_instance < 0:
        raise ServeError("--threads-per-instance must be >= 0 (0: automatic)")
    if not 0 <= args.port <= 65535:
        raise ServeError("--port must be in [0, 65535]")
    for name in ("request_timeout", "instance_stall_timeout", "max_request_retries"):
        if getattr(args, name) < 0:
            raise ServeError(f"--{name.replace('_', '-')} must be >= 0 (0: none)")
    if args.ttft_slo_ms is not None and not 0 < args.ttft_slo_ms < float("inf"):
        raise ServeError("--ttft-slo-ms must be a positive number of milliseconds")
    parse_size(args.kv_cache_memory)
    try:
        check_tracing_flags(args)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ServeError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)")
    source = args.generation_config
    found = os.path.isfile(os.path.join(os.path.expanduser(source), "generation_config.json"))
    if source not in ("auto", "vllm") and not found:
        raise ServeError(
            f"--generation-config {source}: no generation_config.json there (or give auto or vllm)"
        )


def _roles(args: argparse.Namespace) -> list[str]:
    if args.mode == "colocated":
        count = args.num_colocated or args.num_prefill + args.num_decode
        return ["colocated"] * count
    return ["prefill"] * args.num_prefill + ["decode"] * args.num_decode
