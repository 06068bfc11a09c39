"""`pdserve serve` flags, named like `vllm serve`'s where one exists."""

from __future__ import annotations

import argparse
import sys

from pdserve.cluster.autoscale_flags import add_autoscale_flags
from pdserve.cluster.deployment import LAUNCHERS, MODES
from pdserve.cluster.exposure import ExposureError, check_exposure
from pdserve.cluster.help_format import DefaultsHelpFormatter
from pdserve.cluster.ops_flags import add_debug_flags, add_observability_flags
from pdserve.cluster.placement import DEVICES
from pdserve.cluster.precision_flags import add_precision_flags
from pdserve.gateway.routing import DEFAULT_POLICY, POLICIES
from pdserve.gateway.structured import StructuredOutputsConfig, check_structured_outputs_config
from pdserve.gateway.tool_parsers import PARSERS
from pdserve.kvtransfer.config import FAILURE_POLICIES
from pdserve.kvtransfer.transport import TRANSPORTS
from pdserve.scheduler.config import SCHEDULING_POLICIES

TOOL_CALL_PARSERS = tuple(PARSERS)


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible API",
        description="Serve a model: prefill and decode pools (or colocated instances) behind "
        "an OpenAI-compatible HTTP API. With no flags: the embedded SmolLM2-135M-Instruct, "
        "one prefill and one decode instance, on 127.0.0.1:8000.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint folder or Hugging Face id, as in `vllm serve MODEL` (= --model)",
    )
    model = parser.add_argument_group("model and engine")
    _add_model_flags(model)
    _add_structured_output_flags(model)
    _add_http_flags(parser.add_argument_group("HTTP"))
    _add_topology_flags(parser.add_argument_group("topology"))
    _add_scheduler_flags(parser.add_argument_group("global scheduler"))
    add_autoscale_flags(parser.add_argument_group("SLO controller"))
    add_observability_flags(parser.add_argument_group("observability"))
    add_debug_flags(parser.add_argument_group("debugging"))
    parser.set_defaults(handler=_run)
    return parser


def _add_model_flags(model: argparse._ArgumentGroup) -> None:
    model.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, or a Hugging Face id read from the hub cache with "
        "HF_HOME and HF_HUB_OFFLINE (default: the embedded model)",
    )
    model.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (tokenizer.json and its configs) for prompts and text "
        "(default: the model's)",
    )
    model.add_argument(
        "--chat-template",
        default=None,
        help="a chat template file, or the template itself, replacing the tokenizer's",
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        help="where unset sampling parameters come from: auto (the model's "
        "generation_config.json), vllm (SamplingParams' own), or a folder with a "
        "generation_config.json",
    )
    model.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": find tool calls in the model\'s text (needs --tool-call-parser)',
    )
    model.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls, for --enable-auto-tool-choice",
    )
    model.add_argument(
        "--revision", default=None, help="Hugging Face id: branch, tag or commit (default: main)"
    )
    model.add_argument(
        "--download-dir", default=None, help="Hugging Face id: the hub cache to read (and fill)"
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use for the model (default: --model)",
    )
    add_precision_flags(model)
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default: the model's)",
    )
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--max-num-batched-tokens", type=int, default=2048)
    model.add_argument("--block-size", type=int, help="unset: 32 on CPU, 16 on CUDA")
    model.add_argument(
        "--kv-cache-memory", default="2GiB", help="KV cache per instance on CPU, e.g. 2GiB, 512MiB"
    )
    model.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: cuda when a GPU is visible, else cpu",
    )
    model.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of a GPU's memory for the instances on it, split evenly when several "
        "share one (GPU only)",
    )
    _add_step_flags(model)


def _add_step_flags(model: argparse._ArgumentGroup) -> None:
    model.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    model.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="the order waiting requests start in: fcfs, arrival order; lpm, the longest "
        "prefix-cache hit first (a request also waits for blocks another is computing)",
    )
    model.add_argument("--seed", type=int, default=0)
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every decode step op by op: no CUDA graphs, and on CPU no decode steps "
        "recorded as one C call",
    )


def _add_structured_output_flags(model: argparse._ArgumentGroup) -> None:
    model.add_argument(
        "--structured-outputs-config",
        type=_structured_outputs_config,
        default=None,
        metavar="JSON",
        help="structured output's settings, as in vLLM: '{\"disable_any_whitespace\": true}' "
        "makes JSON answers compact (default: any whitespace between tokens)",
    )


def _structured_outputs_config(text: str) -> StructuredOutputsConfig:
    try:
        return check_structured_outputs_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_http_flags(http: argparse._ArgumentGroup) -> None:
    http.add_argument(
        "--host",
        default="127.0.0.1",
        help="beyond loopback (0.0.0.0, a node's address) it needs tenant keys and an "
        "admin key, or --allow-unauthenticated",
    )
    http.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    http.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY', one key for one tenant (without the "
        "flag: the PDSERVE_API_KEY environment variable, if set)",
    )
    http.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help='tenants, their keys and limits: JSON {"tenants": [{"name", "keys": [...], '
        '"requests_per_minute", "tokens_per_minute", "max_concurrent_requests", '
        '"max_tokens_per_request", "models": [...]}]} (limits and models optional)',
    )
    http.add_argument(
        "--admin-api-key",
        default=None,
        help="the key of the operator endpoints (/admin/*, /debug/*); no tenant key opens them "
        "(without the flag: the PDSERVE_ADMIN_API_KEY environment variable, if set)",
    )
    http.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a --host beyond loopback without tenant and admin keys (every "
        "route, /admin/* included, open to whoever reaches the port: only behind a "
        "trusted network)",
    )
    http.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a key (for a scraper inside a trusted network)",
    )
    http.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=None,
        help="the time-to-first-token objective, exported as pdserve:ttft_slo_seconds for "
        "the p95 TTFT alert (deploy/prometheus/alerts.yaml) and kept by --autoscale slo",
    )
    http.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat template (chat_template_kwargs.chat_template; "
        "rendered in a killable child process within a time budget); without it a request "
        "may only name one of the server's templates",
    )
    http.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompts and sampling parameters (INFO, logger "
        "pdserve.gateway.requests); without it no prompt or completion is ever logged",
    )


def _add_topology_flags(topology: argparse._ArgumentGroup) -> None:
    topology.add_argument("--mode", choices=MODES, default="disaggregated")
    topology.add_argument("--num-prefill", type=int, default=1)
    topology.add_argument("--num-decode", type=int, default=1)
    topology.add_argument(
        "--num-colocated",
        type=int,
        default=None,
        help="instances in colocated mode (default: prefill + decode)",
    )
    topology.add_argument(
        "--threads-per-instance",
        type=int,
        default=0,
        help="torch threads per instance (0: max(1, cores // instances))",
    )
    topology.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks (processes) per instance, each with its slice of the weights and KV heads",
    )
    topology.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        help="the prefill pool's own (default: --tensor-parallel-size)",
    )
    topology.add_argument(
        "--decode-tensor-parallel-size",
        type=int,
        default=None,
        help="the decode pool's own (default: --tensor-parallel-size)",
    )
    topology.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages per instance, each a contiguous range of the layers on "
        "--tensor-parallel-size ranks of its own (the same in every pool)",
    )
    topology.add_argument(
        "--max-pool-size",
        type=int,
        default=None,
        help="the most instances POST /admin/pools/{role}/scale may ask for in any pool "
        "(default: per pool, how many of its instances the cores and GPUs hold; a larger "
        "request is a 400)",
    )
    _add_kv_transfer_flags(topology)
    topology.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="ray",
        help="ray: instances as Ray actors; local: plain processes",
    )
    topology.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (default: start a local one); instances then bind and "
        "advertise their node's address (PDSERVE_ADVERTISE_HOST on a node overrides it)",
    )
    for role in ("prefill", "decode", "colocated"):
        topology.add_argument(
            f"--{role}-resources",
            default=None,
            metavar="JSON",
            help=f"Ray custom resources each {role} instance asks for, e.g. "
            """'{"node_a": 1}' (pins the pool to nodes started with them)""",
        )


def _add_kv_transfer_flags(topology: argparse._ArgumentGroup) -> None:
    topology.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default="ucx",
        help="how KV blocks move from prefill to decode: ucx (shared memory on one node), "
        "ucx-listener (TCP/RDMA across nodes), zmq (plain copy)",
    )
    topology.add_argument(
        "--kv-failure-policy",
        choices=FAILURE_POLICIES,
        default="recompute",
        help="a failed KV transfer: recompute the prompt on the decode instance, or fail "
        "the request",
    )
    topology.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="a prefill instance frees handed-off blocks after this long without news "
        "from the decode side",
    )
    topology.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=None,
        help="seconds a decode instance waits for one pull (default: min(10, lease / 2))",
    )


def _add_scheduler_flags(scheduling: argparse._ArgumentGroup) -> None:
    scheduling.add_argument("--routing-policy", choices=sorted(POLICIES), default=DEFAULT_POLICY)
    scheduling.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests admitted beyond the running seats; then 503",
    )
    scheduling.add_argument(
        "--skip-prefill-max-tokens",
        type=int,
        default=0,
        help="prompts this short skip the prefill pool (0: off)",
    )
    scheduling.add_argument(
        "--skip-prefill-min-cached-ratio",
        type=float,
        default=0.0,
        help="prompts cached this much on their decode instance skip the prefill pool (0: off)",
    )
    scheduling.add_argument(
        "--instance-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before an instance is fenced: taken for dead, "
        "killed and replaced",
    )
    scheduling.add_argument(
        "--instance-stall-timeout",
        type=float,
        default=120.0,
        help="seconds an instance may heartbeat while its step loop completes no step "
        "before it is fenced as hung (killed and replaced); longer than your longest "
        "step (0: never)",
    )
    scheduling.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds from a request's arrival to its last token; past it the request "
        "ends with an error (504, or an error event) and is aborted on its instances "
        "(0: no deadline)",
    )
    scheduling.add_argument(
        "--max-request-retries",
        type=int,
        default=2,
        help="times a request whose instance died is sent again (before its first token "
        "from the start; mid-stream migrated with the tokens already streamed as output), "
        "then it ends with an error",
    )


def _run(args: argparse.Namespace) -> int:
    try:  # before the serving stack loads: a refusal is one line within a second
        check_exposure(args)
    except ExposureError as exc:
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2
    from pdserve.cluster.serve import run_serve  # the serving stack loads only for this command

    return run_serve(args)
