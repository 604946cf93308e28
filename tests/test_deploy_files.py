"""Deployment files checked without a Docker engine or devices.

The compose files are parsed and checked against the tier budgets, the pinned Flower and
torch versions, and the flags the installed Flower binaries accept (and validated by
``docker compose config`` / ``docker-compose config`` where one is installed); the
node-config examples resolve to the tier they name; generated certificates and keys load
the way Flower loads them; ``print-hosts`` prints only flags that exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import flwr
import pytest
import torch
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.common.config import parse_config_args

from client.profile import device_profile
from deploy.certs import make_server_cert, make_supernode_key
from deploy.cluster import host_commands
from deploy.flower import BIN, ROOT
from experiment.config import RunConfig
from models.catalog import choose_variant

DOCKER = ROOT / "docker"
TIERS = ("weak", "medium", "strong")
pytestmark = [pytest.mark.slow, pytest.mark.deploy]


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DOCKER / name).read_text())
    assert isinstance(data, dict)
    return data


@cache
@cache
def help_flags(binary: str) -> set[str]:
    cmd = [sys.executable, "-m", binary] if binary == "client.warm" else [str(BIN / binary)]
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, check=False, cwd=ROOT)
    return set(re.findall(r"--[a-z][a-z0-9-]+", out.stdout + out.stderr))


def flags(command: list[str]) -> set[str]:
    return {c for c in command if c.startswith("--")}


@cache
def default_config() -> RunConfig:
    """The run configuration of pyproject.toml's [tool.flwr.app.config]."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return RunConfig.from_flower(table)


def mib(limit: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])", limit.lower())
    assert m, limit
    return float(m.group(1)) * {"k": 1 / 1024, "m": 1, "g": 1024}[m.group(2)]


def test_compose_cluster_matches_flower_binaries_versions_and_tier_budgets() -> None:
    services = load("compose.yaml")["services"]
    version = flwr.__version__
    assert services["superlink"]["image"] == f"flwr/superlink:{version}"
    cfg = default_config()
    est = {v.name: v.memory.total_mb for v in cfg.catalog}
    link = services["superlink"]["command"]
    assert flags(link) <= help_flags("flower-superlink"), flags(link) - help_flags("flower-superlink")
    assert {"--disable-runtime-dependency-installation", "--insecure"} <= flags(link)
    assert link[link.index("--isolation") + 1] == "process" and link[link.index("--fleet-api-type") + 1] == "grpc-rere"
    assert services["serverapp"]["volumes"] == ["results:/app/results"]
    cpus = []
    partitions = []
    for tier in TIERS:
        node, app = services[f"supernode-{tier}"], services[f"clientapp-{tier}"]
        assert node["image"] == f"flwr/supernode:{version}"
        assert flags(node["command"]) <= help_flags("flower-supernode")
        assert node["command"][node["command"].index("--superlink") + 1] == "superlink:9092"
        node_cfg = parse_config_args([node["command"][node["command"].index("--node-config") + 1]])
        assert node_cfg["tier"] == tier and "memory-mb" not in node_cfg  # the budget comes from the cgroup
        partitions.append(node_cfg["partition-id"])
        assert node_cfg["num-partitions"] == len(TIERS)
        # the ClientApp container of this SuperNode: its memory limit is the tier budget ...
        assert flags(app["command"]) <= help_flags("client.warm")
        assert app["command"][-1] == f"supernode-{tier}:9094"
        limit = mib(app["mem_limit"])
        assert mib(app["memswap_limit"]) == limit  # no swap beyond the limit
        assert limit == cfg.memory_budgets[tier], (tier, limit, cfg.memory_budgets)
        # ... which is what the ClientApp reads and sizes its variant to
        profile = device_profile(node_cfg, tiers=cfg.tier_names, proportions=cfg.proportions,
                                 budgets=cfg.memory_budgets, seed=cfg.seed, cgroup_limit_mb=limit)  # fmt: skip
        assert profile.source == "cgroup"
        assert choose_variant(est, profile.memory_mb, cfg.runtime_overhead_mb)[0] == tier
        cpus.append(float(app["cpus"]))
        for svc in (node, app):
            assert svc["environment"]["FLWR_TELEMETRY_ENABLED"] == "0"
            assert svc["restart"] == "unless-stopped"
    assert sorted(partitions) == list(range(len(TIERS)))
    assert cpus == sorted(cpus) and len(set(cpus)) == len(cpus)  # weak < medium < strong


def test_compose_tls_override_turns_on_tls_and_supernode_auth() -> None:
    base = load("compose.yaml")["services"]
    tls = load("compose.tls.yaml")["services"]
    link = tls["superlink"]["command"]
    assert {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth"} <= flags(link)
    assert "--insecure" not in link and flags(link) <= help_flags("flower-superlink")
    # apart from the security flags the commands are the base file's
    security = {"--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth", "--insecure"}
    assert flags(link) - security == flags(base["superlink"]["command"]) - security
    mounted = {v.split(":")[1] for v in tls["superlink"]["volumes"]}
    assert {link[link.index(f) + 1] for f in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile")} <= mounted
    assert "--insecure" not in tls["serverapp"]["command"]
    for tier in TIERS:
        cmd = tls[f"supernode-{tier}"]["command"]
        assert "--insecure" not in cmd and flags(cmd) <= help_flags("flower-supernode")
        mounts = dict(v.rsplit(":", 2)[:2][::-1] for v in tls[f"supernode-{tier}"]["volumes"])
        assert mounts[cmd[cmd.index("--auth-supernode-private-key") + 1]] == f"../certs/supernodes/{tier}"
        assert cmd[cmd.index("--node-config") + 1] == base[f"supernode-{tier}"]["command"][-5]


def test_dockerfile_pins_flower_torch_and_the_projects_dependencies() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert f"ARG FLWR_VERSION={flwr.__version__}" in text
    assert "FROM flwr/superexec:${FLWR_VERSION}" in text
    assert f"ARG TORCH_VERSION={torch.__version__.split('+')[0]}" in text
    assert "download.pytorch.org/whl/cpu" in text  # CPU torch: no CUDA libraries in edge images
    assert {"clientapp", "serverapp"} <= set(re.findall(r"^FROM \S+ AS (\w+)", text, re.M))
    # ClientApp containers run the warm SuperExec: flower-superexec's flags, forked ClientApps
    clientapp = text.split("AS clientapp", 1)[1].split("FROM ", 1)[0]
    assert 'ENTRYPOINT ["python", "-m", "client.warm"]' in clientapp
    assert help_flags("client.warm") == help_flags("flower-superexec")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {re.split(r"[\[<>=!~ ]", d)[0].lower() for d in deps} - {"flwr", "torch"}
    listed = {
        re.split(r"[\[<>=!~ ]", line)[0].lower()
        for line in (DOCKER / "requirements-edge.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert listed == wanted
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / path).exists(), path


def test_compose_config_validates_where_a_compose_implementation_exists() -> None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        cmd = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        cmd = ["docker-compose"]
    elif os.environ.get("CI"):  # `make test-deploy` installs one: in CI this check never skips
        pytest.fail("no compose implementation installed: `make compose-tool` (Debian's docker-compose) adds one")
    else:
        pytest.skip("no compose implementation installed (`make compose-tool` adds Debian's docker-compose)")
    for files in (["compose.yaml"], ["compose.yaml", "compose.tls.yaml"]):
        args = [a for f in files for a in ("-f", str(DOCKER / f))]
        proc = subprocess.run([*cmd, *args, "config", "-q"], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "node-configs").glob("*.toml")), ids=lambda p: p.stem)
def test_node_config_examples_resolve_to_their_tier(path: Path) -> None:
    node_cfg = parse_config_args([str(path)])  # exactly how flower-supernode reads --node-config FILE
    cfg = default_config()
    profile = device_profile(node_cfg, tiers=cfg.tier_names, proportions=cfg.proportions, budgets=cfg.memory_budgets,
                             seed=cfg.seed, cgroup_limit_mb=cfg.memory_budgets[str(node_cfg["tier"])])  # fmt: skip
    est = {v.name: v.memory.total_mb for v in cfg.catalog}
    assert choose_variant(est, profile.memory_mb, cfg.runtime_overhead_mb)[0] == node_cfg["tier"]
    assert 0 <= int(node_cfg["partition-id"]) < int(node_cfg["num-partitions"])


def test_generated_certificates_chain_to_the_ca_and_keys_load_as_flower_loads_them(tmp_path: Path) -> None:
    files = make_server_cert(tmp_path, ["superlink", "127.0.0.1"])
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert files.key.stat().st_mode & 0o077 == 0 and (tmp_path / "ca.key").stat().st_mode & 0o077 == 0
    private, public = make_supernode_key(tmp_path / "nodes", "pi-1")
    key = load_ssh_private_key(private.read_bytes(), password=None)  # flower-supernode's loader
    pub = load_ssh_public_key(public.read_bytes())  # flwr supernode register's loader
    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(pub, ec.EllipticCurvePublicKey)
    assert key.public_key().public_numbers() == pub.public_numbers()


@pytest.mark.parametrize(("tls", "auth"), [(False, False), (True, False), (True, True)])
def test_print_hosts_uses_only_existing_flags(tls: bool, auth: bool) -> None:
    lines = host_commands("10.0.0.5", list(TIERS), tls=tls, auth=auth)
    link = next(line for line in lines if line.startswith("python -m server.superlink "))  # flower-superlink's flags
    nodes = [line for line in lines if line.startswith("python -m client.supernode ")]  # flower-supernode's flags
    assert len(nodes) == len(TIERS)
    assert flags(link.split()[3:]) <= help_flags("flower-superlink")
    assert "--disable-runtime-dependency-installation" in link
    for node in nodes:
        assert flags(node.split()[3:]) <= help_flags("flower-supernode")
        assert ("--root-certificates" in node) == tls and ("--auth-supernode-private-key" in node) == auth
    assert ("--enable-supernode-auth" in link) == auth and ("--insecure" in link) == (not tls)
    assert sum("flwr supernode register" in line for line in lines) == (len(TIERS) if auth else 0)


def test_own_cgroup_limit_is_found_below_the_mount_root(tmp_path: Path) -> None:
    from client.profile import cgroup_memory_limit_mb, own_cgroup_limit_files

    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/outer/inner\n0::/\n")
    files = own_cgroup_limit_files(proc, tmp_path)
    assert files == [
        tmp_path / "memory/outer/inner/memory.limit_in_bytes",
        tmp_path / "memory/outer/memory.limit_in_bytes",
    ]
    for f, mb in zip(files, (900, 700), strict=True):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(str(mb * 1024 * 1024))
    assert min(x for f in files if (x := cgroup_memory_limit_mb([f])) is not None) == 700  # the tighter ancestor
    proc.write_text("0::/kubepods/pod1\n")  # cgroup v2
    assert own_cgroup_limit_files(proc, tmp_path) == [
        tmp_path / "kubepods/pod1/memory.max",
        tmp_path / "kubepods/memory.max",
    ]


def test_prompt_grid_polls_until_every_reply_or_the_timeout() -> None:
    from unittest.mock import MagicMock

    from strategies.grid import PromptGrid

    inner = MagicMock()
    inner.push_messages.return_value = ["a", "b"]
    reply_a, reply_b = MagicMock(), MagicMock()
    reply_a.metadata.reply_to_message_id = "a"
    reply_b.metadata.reply_to_message_id = "b"
    inner.pull_messages.side_effect = [[reply_a], [], [reply_b]]
    grid = PromptGrid(inner, poll_interval=0.01)
    assert list(grid.send_and_receive([MagicMock(), MagicMock()], timeout=5)) == [reply_a, reply_b]
    assert inner.pull_messages.call_count == 3
    inner.pull_messages.side_effect = None
    inner.pull_messages.return_value = []
    assert list(grid.send_and_receive([MagicMock()], timeout=0.05)) == []  # a dead node: gives up at timeout
