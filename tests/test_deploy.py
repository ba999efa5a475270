"""deploy/: the Kubernetes manifests parse and carry what an operator needs
(probes on /health, resources, Prometheus scrape annotations that point at
the server's port, LeaderWorkerSet wiring), every `radixlm serve` command in
the manifests and Dockerfiles is accepted by the real CLI, and
docs/deploy.md covers each file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from server_utils import REPO

from radixlm.config import ServerArgs
from radixlm.server.launch import build_parser

DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile.*"))
# What Kubernetes substitutes into $(VAR) references, as LWS sets them.
ENV_EXAMPLES = {"LWS_LEADER_ADDRESS": "radixlm-multinode-0.radixlm-multinode",
                "LWS_WORKER_INDEX": "1"}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in docs(path)]


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every workload."""
    out = []
    for d in all_docs():
        if d["kind"] == "Deployment":
            out.append((d["metadata"]["name"], d["spec"]["template"]))
        elif d["kind"] == "LeaderWorkerSet":
            lws = d["spec"]["leaderWorkerTemplate"]
            out += [(f"{d['metadata']['name']}/leader", lws["leaderTemplate"]),
                    (f"{d['metadata']['name']}/worker", lws["workerTemplate"])]
    return out


def serve_args(args: list[str]) -> ServerArgs:
    """The server configuration a container's args make, through the real CLI."""
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: ENV_EXAMPLES[m.group(1)], a) for a in args]
    return ServerArgs.from_cli_args(build_parser().parse_args(expanded))


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_manifests_parse() -> None:
    assert MANIFESTS and {d["kind"] for d in all_docs()} >= {"Deployment", "Service",
                                                               "LeaderWorkerSet"}
    for d in all_docs():
        assert d["apiVersion"] and d["metadata"]["name"], d


@pytest.mark.parametrize("where,template", pod_templates(), ids=[w for w, _ in pod_templates()])
def test_pod_templates(where: str, template: dict[str, Any]) -> None:
    (container,) = template["spec"]["containers"]
    args = serve_args(container["args"])
    requests = container["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests)
    assert template["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
    if "nvidia.com/gpu" in requests:
        gpus = int(requests["nvidia.com/gpu"])
        assert gpus == args.tp_size // args.nnodes * args.dp_size
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    if args.node_rank > 0:  # a follower node: no HTTP, so nothing to probe or scrape
        assert "ports" not in container and "readinessProbe" not in container
        return
    assert args.host == "0.0.0.0"  # reachable from outside the pod
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and args.enable_metrics
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", args.port), probe
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == args.port and notes["prometheus.io/path"] == \
        "/metrics"


def test_leader_worker_set() -> None:
    (lws,) = [d for d in all_docs() if d["kind"] == "LeaderWorkerSet"]
    spec = lws["spec"]["leaderWorkerTemplate"]
    leader = spec["leaderTemplate"]["spec"]["containers"][0]["args"]
    worker = spec["workerTemplate"]["spec"]["containers"][0]["args"]
    for args in (leader, worker):
        assert flag(args, "--dist-init-addr").startswith("$(LWS_LEADER_ADDRESS):")
        assert int(flag(args, "--nnodes")) == spec["size"]
        assert flag(args, "--tp-size") == flag(leader, "--tp-size")
        assert flag(args, "--model-path") == flag(leader, "--model-path")
    assert flag(leader, "--node-rank") == "0"
    assert flag(worker, "--node-rank") == "$(LWS_WORKER_INDEX)"
    (service,) = [d for d in docs(DEPLOY / "k8s" / "multinode-lws.yaml")
                  if d["kind"] == "Service"]
    assert service["spec"]["selector"] == spec["leaderTemplate"]["metadata"]["labels"]


def test_services_select_their_pods() -> None:
    deployments = {d["metadata"]["name"]: d for d in all_docs() if d["kind"] == "Deployment"}
    for svc in (d for d in all_docs() if d["kind"] == "Service"):
        name = svc["metadata"]["name"]
        if name in deployments:
            labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
            assert svc["spec"]["selector"].items() <= labels.items()
        assert svc["spec"]["ports"][0]["targetPort"] == "http"


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfiles(path: Path) -> None:
    steps = dockerfile(path)
    assert steps[0][0] == "FROM"
    kinds = dict(steps)
    assert json.loads(kinds["ENTRYPOINT"]) == ["radixlm", "serve"]
    args = serve_args(json.loads(kinds["CMD"]))
    assert args.host == "0.0.0.0" and kinds["EXPOSE"] == str(args.port)
    assert f"127.0.0.1:{args.port}/health" in kinds["HEALTHCHECK"]
    assert kinds["USER"] != "root"
    # The same torch CI installs, and the files the package build needs.
    ci = (REPO / ".ci" / "run").read_text()
    pins = re.findall(r"torch==[\d.]+", path.read_text())
    assert pins and all(p in ci for p in pins)
    copied = " ".join(a for k, a in steps if k == "COPY")
    assert "pyproject.toml" in copied and "radixlm" in copied


def test_docs_cover_every_file() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    for path in [*DOCKERFILES, *MANIFESTS, DEPLOY / "grafana.json"]:
        assert str(path.relative_to(REPO)) in text, path
