"""The hosts file: read with its variant, and every problem one line naming the file, the
field, the value and what would be right, before anything starts (shape here; the machine:
dead pids, pid files, ports in use, executables, in the pre-flight)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from llmchaos.errors import InvalidInput
from llmchaos.settings import RunSettings
from llmchaos.targets.hosts import KIND, HostsSettings, load_topology
from llmchaos.targets.hosts.topology import CATALOGUE_VARIANTS
from llmchaos.validation import validate_experiment_file
from tests.hosts.conftest import LITELLM_EXAMPLE, NGINX_EXAMPLE

SERVER = """\
servers:
  gpu-0:
    mode: gpu
    node: node-a
    engine: vllm
    url: http://127.0.0.1:18999
    command: "{python} -m llmchaos.stack.worker --settings x.json"
"""
GOOD = "front_door: {url: 'http://127.0.0.1:18999'}\n" + SERVER + "max_qps: 5\n"


def _file(tmp_path: Path, text: str, name: str = "hosts.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _one_line(error: pytest.ExceptionInfo[InvalidInput], path: Path, *parts: str) -> str:
    line = str(error.value)
    assert "\n" not in line, line
    for part in (str(path), *parts):
        assert part in line, line
    return line


def test_the_examples_read_with_every_variant() -> None:
    for example, negatives in (
        (LITELLM_EXAMPLE, {"no-failover", "no-cpu-fallback"}),
        (NGINX_EXAMPLE, {"no-failover", "no-cpu-fallback", "no-backup-gateway"}),
    ):
        topology = load_topology(example)
        assert topology.variants[0] == "hardened"
        assert negatives <= set(topology.variants) and negatives <= set(CATALOGUE_VARIANTS)
        for variant in topology.variants:
            assert load_topology(example, variant).servers == topology.servers


def test_a_variant_overrides_and_null_removes() -> None:
    good = load_topology(NGINX_EXAMPLE)
    bad = load_topology(NGINX_EXAMPLE, "no-backup-gateway")
    assert [g.name for g in good.gateways] == ["front", "gateway-primary", "gateway-backup"]
    assert [g.name for g in bad.gateways] == ["front", "gateway-primary"]
    assert "front-no-backup.conf" in " ".join(bad.gateways[0].command)
    assert load_topology(LITELLM_EXAMPLE, "no-failover").gateways[0].command != (
        load_topology(LITELLM_EXAMPLE).gateways[0].command
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            GOOD.replace("engine: vllm", "engine: vlm"),
            ("servers.gpu-0.engine", "'vlm'", "vllm, sglang, tgi, llamacpp, openai"),
        ),
        (
            GOOD.replace("    command:", "    comand:"),
            ("servers.gpu-0", "expected exactly one of pid", "did you mean 'command'"),
        ),
        (GOOD.replace("mode: gpu", "mode: tpu"), ("servers.gpu-0.mode", "'tpu'", "gpu or cpu")),
        (
            GOOD.replace("http://127.0.0.1:18999\n    command", "localhost\n    command"),
            ("servers.gpu-0.url", "'localhost'", "http://127.0.0.1:8000"),
        ),
        (
            GOOD.replace("front_door: {", "front_door: {token: sk-123, "),
            ("front_door.token", "generate or {env: VARIABLE}", "never written in the file"),
        ),
        (
            GOOD.replace("--settings x.json", "--key {token}"),
            ("servers.gpu-0.command", "{token}", "visible to every user"),
        ),
        (GOOD.replace("max_qps: 5\n", ""), ("max_qps", "required")),
        (GOOD.replace("max_qps: 5", "max_qps: 0"), ("max_qps", "> 0", "got 0")),
        (GOOD + "varients: {}\n", ("varients", "did you mean 'variants'")),
    ],
    ids=[
        "unknown-engine",
        "no-pid-nor-command",
        "bad-mode",
        "bad-url",
        "token-in-file",
        "token-on-command-line",
        "no-max-qps",
        "zero-max-qps",
        "unknown-section",
    ],
)
def test_each_problem_is_one_line(tmp_path: Path, text: str, expected: tuple[str, ...]) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(InvalidInput) as error:
        load_topology(path)
    lines = str(error.value).splitlines()
    assert len(lines) == 1 + ("did you mean 'command'" in expected), lines  # unknown key too
    joined = "\n".join(lines)
    for part in (str(path), *expected):
        assert part in joined, joined


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = GOOD.replace("engine: vllm", "engine: vlm").replace("mode: gpu", "mode: tpu")
    path = _file(tmp_path, text.replace("max_qps: 5\n", ""))
    with pytest.raises(InvalidInput) as error:
        load_topology(path)
    lines = str(error.value).splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{path}: ") for line in lines), lines


def test_unreadable_file_bad_yaml_and_unknown_variant(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(InvalidInput) as error:
        load_topology(missing)
    _one_line(error, missing, "cannot read the hosts file", "LLMCHAOS_HOSTS_FILE")
    broken = _file(tmp_path, "servers: [unclosed\n")
    with pytest.raises(InvalidInput) as error:
        load_topology(broken)
    _one_line(error, broken, "not valid YAML or JSON")
    with pytest.raises(InvalidInput) as error:
        load_topology(LITELLM_EXAMPLE, "no-backup-gateway")
    _one_line(error, LITELLM_EXAMPLE, "unknown variant 'no-backup-gateway'", "no-failover")


def test_settings_require_the_file_and_cap_the_rate() -> None:
    with pytest.raises(InvalidInput, match=r"hosts_file \(LLMCHAOS_HOSTS_FILE\): required"):
        RunSettings.from_configuration({"target": "hosts"}, {})
    settings = RunSettings.from_configuration(
        {"target": "hosts", "qps": 5000}, {"LLMCHAOS_HOSTS_FILE": str(LITELLM_EXAMPLE)}
    )
    assert isinstance(settings.target_settings, HostsSettings)
    assert settings.effective_qps == 8  # the file's max_qps
    assert RunSettings.from_record(settings.to_dict()) == settings
    with pytest.raises(InvalidInput, match="unknown variant 'naive-cache'"):
        RunSettings.from_configuration(
            {"target": "hosts", "hosts_file": str(LITELLM_EXAMPLE), "variant": "naive-cache"}, {}
        )


# -- the pre-flight: the file against this machine --------------------------------------
def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _plan_problems(path: Path) -> list[str]:
    with pytest.raises(InvalidInput) as error:
        KIND.plan(HostsSettings(file=str(path)))
    return str(error.value).splitlines()


def test_dead_pid_missing_pid_file_port_in_use_missing_executable(tmp_path: Path) -> None:
    dead = _dead_pid()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        text = (
            "front_door: {url: 'http://127.0.0.1:1'}\nmax_qps: 5\nservers:\n"
            f"  gpu-0: {{node: a, url: 'http://127.0.0.1:1', pid: {dead}}}\n"
            f"  gpu-1: {{node: b, url: 'http://127.0.0.1:2', pid_file: {tmp_path}/vllm.pid}}\n"
            f"  cpu-0: {{mode: cpu, node: c, url: 'http://127.0.0.1:{busy}', command: 'sleep 9'}}\n"
            "gateways:\n"
            "  litellm: {url: 'http://127.0.0.1:3', command: '/nowhere/bin/litellm'}\n"
        )
        path = _file(tmp_path, text)
        problems = _plan_problems(path)
    assert len(problems) == 4, problems
    assert all(p.startswith(f"{path}: ") for p in problems), problems
    by_field = {p.split(": ")[1]: p for p in problems}
    assert f"no process {dead} is running" in by_field["servers.gpu-0.pid"]
    assert "cannot read pid file" in by_field["servers.gpu-1.pid_file"]
    assert f"port {busy} is already in use by pid {os.getpid()}" in by_field["servers.cpu-0.url"]
    assert "'/nowhere/bin/litellm' not found; make setup" in by_field["gateways.litellm.command"]


def test_a_live_pid_passes_and_a_missing_token_variable_does_not(tmp_path: Path) -> None:
    text = (
        "front_door: {url: 'http://127.0.0.1:1', token: {env: LLMCHAOS_TEST_NO_SUCH_TOKEN}}\n"
        "max_qps: 5\nservers:\n"
        f"  gpu-0: {{node: a, url: 'http://127.0.0.1:1', pid: {os.getpid()}}}\n"
    )
    problems = _plan_problems(_file(tmp_path, text))
    assert len(problems) == 1 and "LLMCHAOS_TEST_NO_SUCH_TOKEN is not set" in problems[0]


def test_llmchaos_validate_reports_the_hosts_file(tmp_path: Path) -> None:
    text = GOOD.replace("engine: vllm", "engine: triton")
    path = _file(tmp_path, text)
    env = {**os.environ, "LLMCHAOS_TARGET": "hosts", "LLMCHAOS_HOSTS_FILE": str(path)}
    result = subprocess.run(
        [str(Path(sys.executable).with_name("llmchaos")), "validate", "experiments/gpu_kill.json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{path}: servers.gpu-0.engine: unknown engine kind 'triton'" in result.stdout


def test_a_catalogue_experiment_that_does_not_apply_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLMCHAOS_TARGET", "hosts")
    monkeypatch.setenv("LLMCHAOS_HOSTS_FILE", str(LITELLM_EXAMPLE))
    joined = "\n".join(validate_experiment_file(REPO / "experiments" / "gateway_crash.json"))
    assert "unknown variant 'no-backup-gateway' of the hosts target" in joined
    assert "unknown gateway 'primary'" in joined
    # a fault the target can do but not with every argument: the argument and the reason
    joined = "\n".join(validate_experiment_file(REPO / "experiments" / "network_degradation.json"))
    assert "arguments.rate_kbit: a bandwidth cap (tc tbf) shapes a whole device" in joined
    assert "delay_ms" not in joined and "loss_percent" not in joined  # those it can
