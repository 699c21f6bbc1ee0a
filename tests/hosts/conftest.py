"""Fixtures of the hosts target's tests: hosts files with free ports in the test's folder,
and the real parts they need (nginx, LiteLLM, root for iptables): skipped when missing,
except under CI (CI set), which must test them."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from conftest import REPO
from llmchaos.stack.procs import free_port

LITELLM = REPO / ".venv-litellm" / "bin" / "litellm"
LITELLM_EXAMPLE = REPO / "experiments" / "targets" / "litellm.yaml"
NGINX_EXAMPLE = REPO / "experiments" / "targets" / "nginx.yaml"
NGINX_FLAGS = "-g 'daemon off; pid nginx.pid;'"
"""nginx in the foreground (llmchaos supervises it), its pid file under its prefix."""
GPU_LOAD_S = 1.5
"""Model load of a restarted worker in these tests: long enough to see, short to wait for."""


def _needs(missing: str | None) -> None:
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must test the hosts target with its real parts: {missing}")
    pytest.skip(missing)


@pytest.fixture
def needs_root() -> None:
    _needs(
        None
        if os.geteuid() == 0 and shutil.which("iptables")
        else "partitions need root and iptables"
    )


@pytest.fixture
def needs_nginx() -> None:
    _needs(None if shutil.which("nginx") else "nginx not installed (apt-get install nginx)")


@pytest.fixture
def needs_litellm() -> None:
    _needs(None if LITELLM.exists() else f"LiteLLM not installed: {LITELLM} (make setup)")


def worker_command(settings: Path, node: str, restart: bool = False) -> str:
    return (
        f"{{python}} -m llmchaos.stack.worker --settings {settings} --name {{name}} "
        f"--node {node} --port {{port}}" + (" --restart" if restart else "")
    )


def write_hosts_file(folder: Path, *, nginx: bool, extra: str = "") -> Path:
    """A hosts file of two simulated GPU workers (node-a, node-b) and, with `nginx`, an nginx
    gateway in front of them (the front door; else gpu-1 is), on free ports."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = folder / "gpu.json"
    settings.write_text(json.dumps({"profile": {"load_s": GPU_LOAD_S, "first_load_s": 0.3}}))
    ports = {name: free_port() for name in ("gpu-0", "gpu-1", "gateway-primary")}
    servers = "".join(
        textwrap.dedent(
            f"""\
              {name}:
                mode: gpu
                node: {node}
                engine: vllm
                url: http://127.0.0.1:{ports[name]}
                command: "{worker_command(settings, node)}"
                restart_command: "{worker_command(settings, node, restart=True)}"
                restart_delay_s: 0.3
            """
        )
        for name, node in (("gpu-0", "node-a"), ("gpu-1", "node-b"))
    )
    front = ports["gateway-primary"] if nginx else ports["gpu-1"]
    text = f"front_door: {{url: 'http://127.0.0.1:{front}'}}\nservers:\n"
    text += textwrap.indent(servers, "  ")
    if nginx:
        conf = folder / "nginx.conf"
        conf.write_text(
            textwrap.dedent(
                f"""\
                worker_processes 2;
                events {{ worker_connections 256; }}
                http {{
                  access_log off;
                  client_body_buffer_size 1m;
                  proxy_temp_path tmp-proxy;
                  client_body_temp_path tmp-body;
                  upstream upstreams {{
                    server 127.0.0.1:{ports["gpu-0"]} max_fails=1 fail_timeout=2s;
                    server 127.0.0.1:{ports["gpu-1"]} max_fails=1 fail_timeout=2s;
                  }}
                  server {{
                    listen 127.0.0.1:{ports["gateway-primary"]};
                    location = /nginx-health {{ return 200; }}
                    location / {{ proxy_pass http://upstreams; }}
                  }}
                }}
                """
            )
        )
        text += textwrap.dedent(
            f"""\
            gateways:
              gateway-primary:
                url: http://127.0.0.1:{ports["gateway-primary"]}
                health: /nginx-health
                command: "nginx -p {{state}}/ -c {conf} -e {{state}}/error.log {NGINX_FLAGS}"
            """
        )
    path = folder / "hosts.yaml"
    path.write_text(text + "max_qps: 5\n" + extra)
    return path
