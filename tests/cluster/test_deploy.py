"""deploy/: the Dockerfile's and the KubeRay RayCluster's `pdserve serve` command lines
must parse with the CLI's own parser (so they cannot rot), and the custom resources
the pools ask for must exist on some worker group."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import yaml

from pdserve.cli import build_parser
from pdserve.cluster.deployment import ray_resources

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
    documents = list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))
    cluster = next(d for d in documents if d["kind"] == "RayCluster")
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
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "PDSERVE_DEPLOYMENT_SECRET" not in " ".join(head.get("args", []))  # env only
    assert any(e["name"] == "PDSERVE_DEPLOYMENT_SECRET" for e in head["env"])
