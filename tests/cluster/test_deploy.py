"""deploy/: the Dockerfile's and the KubeRay RayCluster's `pdserve serve` command lines
must parse with the CLI's own parser (so they cannot rot), and the custom resources
the pools ask for must exist on some worker group. No shipped file binds beyond
loopback without keys that come from secrets (environment or mounted files, never a
command line), and the deployment secret comes as a file."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.cluster.deployment import ray_resources
from pdserve.cluster.exposure import ExposureError, check_exposure, is_loopback

DEPLOY = Path(__file__).parents[2] / "deploy"
# What the pods' environment supplies to the command line.
POD_ENV = {"POD_IP": "10.1.2.3", "KUBERAY_GEN_RAY_START_CMD": "ray start --head"}


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """`argv` after `pdserve`; fails the test with argparse's own message."""
    assert argv[:1] == ["serve"], argv
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"pdserve {shlex.join(argv)}: {errors.getvalue()}") from None


def test_the_dockerfile_runs_a_valid_pdserve_serve() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    assert cmd, "the Dockerfile has no exec-form CMD"
    argv = json.loads(cmd.group(1))
    assert argv[0] == "pdserve"
    args = parse_serve(argv[1:])
    assert args.host == "0.0.0.0"  # reachable from outside the container
    assert "ENTRYPOINT" not in text
    # Safe by default: without keys in its environment the image refuses to serve.
    assert not args.allow_unauthenticated and args.api_key is None
    with pytest.raises(ExposureError):
        check_exposure(args, environ={})
    check_exposure(args, environ={"PDSERVE_API_KEY": "k", "PDSERVE_ADMIN_API_KEY": "a"})
    # The image itself carries no key nor secret.
    joined = text.replace("\\\n", " ")  # continuation lines joined
    for line in re.findall(r"^(?:ENV|ARG)\b.*$", joined, re.MULTILINE):
        assert "KEY" not in line and "SECRET" not in line, line


def serve_lines(cluster: dict) -> list[list[str]]:
    """Every `pdserve serve ...` in the cluster's containers, split as a shell would."""
    found = []
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            for part in [*container.get("command", []), *container.get("args", [])]:
                script = _expand(part)
                for command in re.split(r"&&|;", script):
                    words = shlex.split(command)
                    if words[:1] == ["exec"]:
                        words = words[1:]
                    if words[:2] == ["pdserve", "serve"]:
                        found.append(words[1:])
    return found


def _expand(text: str) -> str:
    return re.sub(r"\$(\w+)", lambda m: POD_ENV.get(m.group(1), m.group(0)), text)


def test_the_kuberay_cluster_runs_a_valid_pdserve_serve_on_its_head() -> None:
    cluster = kuberay_cluster()
    lines = serve_lines(cluster)
    assert len(lines) == 1, lines
    args = parse_serve(lines[0])
    assert args.launcher == "ray" and args.ray_address == "10.1.2.3:6379"
    assert args.host == "0.0.0.0"
    asked = ray_resources(args)
    offered: set[str] = set()
    for group in cluster["spec"]["workerGroupSpecs"]:
        # KubeRay's quoting: a JSON object inside a quoted string.
        text = group["rayStartParams"].get("resources", '"{}"')
        offered |= set(json.loads(json.loads(text)))
    for role, resources in asked.items():
        assert set(resources) <= offered, (role, resources, offered)


def kuberay_cluster() -> dict:
    documents = list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))
    return next(d for d in documents if d["kind"] == "RayCluster")


def pod_specs(cluster: dict) -> list[dict]:
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


def from_secret(entry: dict) -> bool:
    """An environment entry whose value a Kubernetes secret holds (never a literal)."""
    return "value" not in entry and "secretKeyRef" in entry.get("valueFrom", {})


def test_the_kuberay_head_binds_beyond_loopback_only_with_keys_from_secrets() -> None:
    head = pod_specs(kuberay_cluster())[0]["containers"][0]
    args = parse_serve(serve_lines(kuberay_cluster())[0])
    assert not is_loopback(args.host)
    assert not args.allow_unauthenticated
    assert args.api_key is None and args.admin_api_key is None  # never a command line
    secret_env = {e["name"]: "from-a-secret" for e in head["env"] if from_secret(e)}
    check_exposure(args, environ=secret_env)
    literal = {e["name"] for e in head["env"] if not from_secret(e)}
    assert not literal & {"PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY", "PDSERVE_DEPLOYMENT_SECRET"}


def test_every_kuberay_node_reads_the_deployment_secret_from_a_file_of_a_secret() -> None:
    for pod in pod_specs(kuberay_cluster()):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert "PDSERVE_DEPLOYMENT_SECRET" not in env  # the file, not the environment
            path = env["PDSERVE_DEPLOYMENT_SECRET_FILE"]["value"]
            mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"]))
            assert mount.get("readOnly") and "emptyDir" in volumes[mount["name"]]
            # An init container fills that volume from a secret volume, 0600.
            init = next(
                c for c in pod["initContainers"]
                if any(m["name"] == mount["name"] for m in c["volumeMounts"])
            )  # fmt: skip
            sources = [m for m in init["volumeMounts"] if "secret" in volumes[m["name"]]]
            assert sources and path.rsplit("/", 1)[-1] in init["command"][-1]
            assert init["command"][:3] == ["install", "-m", "600"]


def test_no_deploy_file_binds_everywhere_without_keys() -> None:
    for path in DEPLOY.rglob("*"):
        if path.is_file() and "0.0.0.0" in path.read_text():
            assert path.name in {"Dockerfile", "raycluster.yaml"}, path  # checked above
