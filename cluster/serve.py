"""`pdserve serve`: the gateway in this process, the instances through a launcher.

Order of events: check the flags; bind the HTTP port (a taken port fails at once, not
after the weights load); with `--ray-address`, join the cluster and plan again on its
inventory; make the deployment secret (unless the environment brings one); start the
gateway (its ZMQ output socket) and the HTTP server
(/health and /v1/models answer 503 until every instance is ready); launch the
instances, registering each with the gateway as it becomes ready; print one "serving"
line; serve until SIGINT/SIGTERM, restarting instances whose process exits
(`cluster/supervisor.py`); then stop the HTTP server, the instances and the
gateway, in that order. A second Ctrl-C skips the graceful wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import msgspec
import uvicorn

from pdserve.cluster.addresses import LOOPBACK, across_nodes, instance_host, node_host
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.http_server import uvicorn_config
from pdserve.cluster.launcher import Launcher, LaunchError
from pdserve.cluster.local_launcher import LocalLauncher
from pdserve.cluster.ops_flags import detail_modules
from pdserve.cluster.placement import load_waves
from pdserve.cluster.pools import Pools
from pdserve.cluster.supervisor import Supervisor
from pdserve.common import wire_auth
from pdserve.common.messages import InstanceInfo
from pdserve.common.named_values import named_values
from pdserve.common.wire_auth import SecretError, ensure_secret
from pdserve.engine.embedded import EmbeddedModelError, served_model_path
from pdserve.gateway.app import create_app
from pdserve.gateway.gateway import Gateway, GatewayConfig
from pdserve.instance.spec import InstanceSpec
from pdserve.text.tokenizer import TokenizerError

logger = logging.getLogger("pdserve.serve")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `pdserve serve` owns SIGINT/SIGTERM so it
    can stop the instances before it exits."""

    def capture_signals(self):  # noqa: ANN201 - a context manager, as in uvicorn
        return contextlib.nullcontext()


def run_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.enable_log_requests:
        logging.getLogger("pdserve.gateway.requests").setLevel(logging.INFO)
    try:
        deployment = Deployment.from_args(args)
        model_path = deployment.model_path or str(default_model(deployment))
        listener = bind_listener(args.host, args.port)
        # Made once here and inherited (environment) by every instance; never argv.
        ensure_secret()
    except (ServeError, EmbeddedModelError, SecretError) as exc:
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        zmq_host = LOOPBACK
        if across_nodes(args.launcher, args.ray_address):
            deployment, zmq_host = deployment_on_cluster(deployment, listener.getsockname()[1])
        return asyncio.run(serve(deployment, model_path, listener, zmq_host))
    except ServeError as exc:
        listener.close()
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2
    except (LaunchError, TokenizerError) as exc:
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 1


def default_model(deployment: Deployment) -> Path:
    """What an instance serves when no model is given: the embedded model as its engine
    config serves it best (on CPU its own Q4_1 file, packed: `engine/embedded.py`)."""
    engine = deployment.engine
    return served_model_path(engine.device, engine.dtype, engine.quantization)


def deployment_secret() -> bytes:
    """The deployment's one secret (`common/wire_auth.py`: the environment or its
    0600 file, else random for this run), which also keys every tenant's cache salt."""
    return wire_auth.deployment_secret()


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def deployment_on_cluster(deployment: Deployment, port: int) -> tuple[Deployment, str]:
    """Joins the Ray cluster of `--ray-address` and plans again on its CPUs and GPUs;
    returns the deployment and the address the gateway binds (this node's, so instances on
    other nodes reach it)."""
    from pdserve.cluster.ray_cluster import inventory, join  # Ray loads only when asked for

    join(deployment.args.ray_address, ray_namespace(port))
    found = inventory()
    return Deployment.from_args(deployment.args, found.cores, found.gpus), node_host()


def ray_namespace(port: int) -> str:
    return f"pdserve-{port}"


def make_launcher(deployment: Deployment, port: int) -> Launcher:
    if deployment.args.launcher == "local":
        return LocalLauncher()
    from pdserve.cluster.ray_launcher import RayLauncher  # Ray loads only when asked for

    return RayLauncher(
        address=deployment.args.ray_address,
        namespace=ray_namespace(port),
        num_cpus={i.instance_id: i.num_cpus for i in deployment.instances},
        num_gpus={i.instance_id: i.num_gpus for i in deployment.instances},
        resources=deployment.resources,
    )


def instance_specs(
    deployment: Deployment, model_path: str, gateway_address: str, ray: bool = False
) -> list[list[InstanceSpec]]:
    """The instances' specs in load waves (instances sharing a GPU load one at a time).
    Ray sets each actor's CUDA_VISIBLE_DEVICES itself; the local launcher uses `gpus`.
    Across nodes an instance binds its node's address and is pinned to no cores (the
    cores counted are the cluster's, not one machine's)."""
    args = deployment.args
    spread = across_nodes(args.launcher, args.ray_address)
    waves = []
    for wave in load_waves(deployment.instances):
        specs = []
        for planned in wave:
            engine = msgspec.structs.replace(
                deployment.engine,
                model=model_path,
                num_threads=planned.num_threads,
                tensor_parallel_size=deployment.tensor_parallel.get(planned.role, 1),
            )
            if planned.device == "cuda":
                engine = msgspec.structs.replace(
                    engine, gpu_memory_utilization=planned.gpu_memory_utilization
                )
            host = instance_host(spread)
            kv_transfer = deployment.kv_transfer
            if kv_transfer is not None:
                kv_transfer = msgspec.structs.replace(
                    kv_transfer, instance_id=planned.instance_id, host=host
                )
            spec = InstanceSpec(
                instance_id=planned.instance_id,
                role=planned.role,
                gateway_address=gateway_address,
                host=host,
                engine=engine,
                test_hooks=args.enable_test_hooks,
                kv_transfer=kv_transfer,
                cpus=[] if spread else planned.cpus,
                gpus=[] if ray else list(planned.gpus),
            )
            specs.append(spec)
        waves.append(specs)
    return waves


def exited(gateway: Gateway, supervisor: Supervisor, instance_id: str, reason: str) -> None:
    """(event loop) An instance's process exited: the gateway retires it (its requests
    migrated, retried or failed), then the supervisor starts it again in the next epoch;
    one drained and stopped leaves the books."""
    gateway.instance_lost(instance_id, reason)
    if not supervisor.knows(instance_id):
        gateway.scheduler.forget(instance_id)
        gateway.metrics.roles.forget(instance_id)  # it serves in no role any more
        gateway.dispatcher.timelines.forget_instance(instance_id)  # and keeps no clock
        return
    view = gateway.scheduler.views.get(instance_id)
    supervisor.instance_exited(instance_id, view.epoch if view is not None else 0)


def instance_summary(info: InstanceInfo) -> str:
    """One line per ready instance: what it runs (model, precision, device, kernels),
    its KV cache, and how many requests of full length (`max_model_len`) its blocks
    hold at once."""
    blocks_per_request = -(-info.max_model_len // info.block_size)
    fit = info.num_blocks // blocks_per_request
    model = os.path.basename(info.model_path.rstrip("/")) or info.model_path
    weights = f", weights {info.weight_bytes / 2**20:.0f} MiB" if info.weight_bytes else ""
    if weights and info.quantization:
        weights += f" ({info.quantization})"
    scales = f", scales {info.kv_scales}" if info.kv_scales else ""
    kv = f" ({info.kv_cache_dtype}{scales}, {info.kv_bytes_per_token} bytes/token)"
    return (
        f"pdserve: {info.address.instance_id}: {model}, {info.dtype or '?'} on "
        f"{info.device or '?'}{weights}, {info.num_blocks} KV blocks x {info.block_size} = "
        f"{info.num_blocks * info.block_size} tokens{kv if info.kv_cache_dtype else ''}, "
        f"{fit} requests of "
        f"{info.max_model_len} tokens (max_model_len) fit at once"
        + (f"; kernels: {info.kernels}" if info.kernels else "")
    )


def describe(deployment: Deployment) -> str:
    """ "prefill-0 (GPU 0, 0.45 of its memory), decode-0 (GPUs 1,2, 0.90 of their
    memory)" or the ids on CPU."""
    parts = []
    for planned in deployment.instances:
        name, gpus = planned.instance_id, ",".join(planned.gpus)
        share = planned.gpu_memory_utilization
        if not planned.gpus:
            parts.append(name)
        elif len(planned.gpus) == 1:
            parts.append(f"{name} (GPU {gpus}, {share:.2f} of its memory)")
        else:
            parts.append(f"{name} (GPUs {gpus}, {share:.2f} of their memory)")
    return ", ".join(parts)


# GatewayConfig fields taken as they are from the flag of the same name.
GATEWAY_FLAGS = (
    "max_model_len",
    "enable_test_hooks",
    "trust_request_chat_template",
    "enable_log_requests",
    "metrics_public",
    "ttft_slo_ms",
    "otlp_traces_endpoint",
)
# GatewayConfig fields taken from the Deployment's of the same name (checked or read there).
DEPLOYMENT_SETTINGS = (
    "served_model_names",
    "api_key",
    "scheduler",
    "chat_template",
    "api_keys",
    "admin_api_key",
)


def gateway_config(deployment: Deployment, model_path: str, zmq_host: str) -> GatewayConfig:
    args = deployment.args
    structured = args.structured_outputs_config
    return GatewayConfig(
        model_path=model_path,
        expected_instances=len(deployment.instances),
        tokenizer_path=args.tokenizer,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        disable_any_whitespace=bool(structured and structured.disable_any_whitespace),
        deployment_secret=deployment_secret(),
        request_timeout_s=args.request_timeout,
        autoscale=deployment.autoscale,
        collect_detailed_traces=detail_modules(args),
        zmq_host=zmq_host,
        **named_values(args, GATEWAY_FLAGS),
        **named_values(deployment, DEPLOYMENT_SETTINGS),
    )


def make_gateway(deployment: Deployment, model_path: str, zmq_host: str) -> Gateway:
    return Gateway(gateway_config(deployment, model_path, zmq_host))


async def serve(
    deployment: Deployment, model_path: str, listener: socket.socket, zmq_host: str = LOOPBACK
) -> int:
    """`zmq_host`: where the gateway's output socket binds (this node's address when
    instances may run on other nodes)."""
    args = deployment.args
    host, port = listener.getsockname()[:2]
    gateway = make_gateway(deployment, model_path, zmq_host)
    gateway.start()
    server = _Server(uvicorn_config(create_app(gateway), args.log_level))
    launcher = make_launcher(deployment, port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            server.force_exit = True
        stop.set()
        server.should_exit = True
        launcher.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    serving = loop.create_task(server.serve(sockets=[listener]))
    code, supervisor, pools = 0, None, None
    try:
        waves = instance_specs(
            deployment, model_path, gateway.output_address, args.launcher == "ray"
        )
        specs = [spec for wave in waves for spec in wave]
        print(
            f"pdserve: starting {len(specs)} instance(s) ({args.mode}, {args.launcher} "
            f"launcher, {deployment.engine.device}): {describe(deployment)}",
            file=sys.stderr,
            flush=True,
        )

        def on_ready(info: InstanceInfo) -> None:
            print(instance_summary(info), file=sys.stderr, flush=True)
            loop.call_soon_threadsafe(gateway.register, info)

        for wave in waves:
            await loop.run_in_executor(None, launcher.launch, wave, on_ready)
        supervisor = Supervisor(launcher, specs, on_ready)
        pools = Pools(launcher, supervisor, on_ready, deployment.max_pool_sizes)
        gateway.pools = pools
        gateway.dispatcher.on_fenced = supervisor.fence
        launcher.watch(
            lambda i, why: loop.call_soon_threadsafe(exited, gateway, supervisor, i, why)
        )
        print(f"pdserve: serving {gateway.model_name} on http://{host}:{port}", flush=True)
        waiter = loop.create_task(stop.wait())
        await asyncio.wait({waiter, serving}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    except LaunchError as exc:
        if not stop.is_set():
            print(f"pdserve serve: error: {exc}", file=sys.stderr, flush=True)
            code = 1
    finally:
        print("pdserve: shutting down", file=sys.stderr, flush=True)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, timeout=10)
        if pools is not None:
            pools.close()
        if supervisor is not None:
            supervisor.close()
        await loop.run_in_executor(None, launcher.shutdown)
        await gateway.close()
        listener.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return code
