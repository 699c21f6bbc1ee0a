"""Secrets never land on disk or in logs: URLs with credentials, passwords, bearer tokens are
masked in run.json, journals, summaries, reports and logs; the files that must hold them (the
tokens file, the token table, the stack's secrets file) are mode 600."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import REPO
from llmchaos.redact import MASK, redact, redact_text
from llmchaos.run import ChaosRun
from llmchaos.settings import RunSettings

SECRET_STORES = ("tokens.json", "tokens.sqlite", "tokens.sqlite-wal", "tokens.sqlite-shm")
"""Files of a stack state folder that hold secrets by design, besides secrets.json."""

passwords = st.text(
    alphabet=st.characters(codec="ascii", categories=["L", "N"]), min_size=6, max_size=20
)


def _settings_with(password: str) -> dict[str, object]:
    return {
        "redis_url": f"redis://:{password}@redis:6379/0",
        "gateway_url": f"https://svc:{password}@gateway:8443",
        "redis_cli": ["redis-cli", "-a", password],
        "header": f"Authorization: Bearer {password}",
        "command": f"redis-cli --pass {password} ping",
        "redis_cli_list": f"redis-cli,-a,{password}",
        "api_token": password,
        "tokens_file": "/srv/tokens.json",
        "bad_tokens": "mixed",
    }


@given(password=passwords)
def test_credentials_in_urls_flags_and_bearer_tokens_are_masked(password: str) -> None:
    masked = redact(_settings_with(password))
    # Nothing of the password is left: masked, the settings read the same whatever it was
    # (a search for the password itself would find "comman" in "command").
    assert masked == redact(_settings_with("other-password"))
    assert MASK in json.dumps(masked) and "other-password" not in json.dumps(masked)
    assert masked["redis_url"] == f"redis://:{MASK}@redis:6379/0"
    assert masked["gateway_url"] == f"https://svc:{MASK}@gateway:8443"
    assert masked["tokens_file"] == "/srv/tokens.json" and masked["bad_tokens"] == "mixed"
    assert redact_text("http://127.0.0.1:8800/v1") == "http://127.0.0.1:8800/v1"


def test_a_k8s_runs_folder_holds_no_redis_password(tmp_path: Path) -> None:
    password = "hunter2-k8s"
    settings = RunSettings.from_configuration(
        {
            "target": "k8s",
            "runs_root": str(tmp_path),
            "k8s_allowed_namespaces": "llm-serving",
            "k8s_namespace": "llm-serving",
            "k8s_redis_url": f"redis://:{password}@redis.llm-serving:6379/0",
            "k8s_redis_cli": f"redis-cli,-a,{password}",
        },
        {},
    )
    run = ChaosRun.open(settings, "secrets", "a k8s run")
    try:
        run.save_journal({"experiment": {"configuration": settings.to_dict()}})
        text = (run.run_dir / "run.json").read_text() + (run.run_dir / "journal.json").read_text()
    finally:
        run.close("finished")
    assert password not in text
    assert f"redis://:{MASK}@redis.llm-serving:6379/0" in text


@pytest.mark.slow
def test_no_secret_anywhere_after_a_run(tmp_path: Path, needs_netns: None) -> None:
    """token_cache_expiry with bad tokens: the stack's Redis requires a password, the load
    sends bearer tokens (valid, revoked and unknown ones). Afterwards neither the password nor
    any token is in any file of the run folder, the stack folder (but its secret stores) or
    the logs."""
    runs, stacks = tmp_path / "runs", tmp_path / "stacks"
    log_file, journal = tmp_path / "chaostoolkit.log", tmp_path / "journal.json"
    env = {
        "LLMCHAOS_RUNS_ROOT": str(runs),
        "LLMCHAOS_STACKS_ROOT": str(stacks),
        "LLMCHAOS_WARMUP_S": "3",
        "LLMCHAOS_BAD_TOKEN_SHARE": "0.2",
    }
    chaos = str(Path(sys.executable).with_name("chaos"))
    experiment = REPO / "experiments" / "token_cache_expiry.json"
    done = subprocess.run(
        [chaos, "--log-file", str(log_file), "run", "--journal-path", str(journal), experiment],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "chaos-output.log").write_text(done.stdout + done.stderr)
    (stack,) = [p for p in stacks.iterdir() if p.is_dir()]
    stack_secrets = json.loads((stack / "secrets.json").read_text())
    tokens = [t["token"] for t in json.loads((stack / "tokens.json").read_text())["tokens"]]
    secrets = [stack_secrets["redis_password"], *tokens]
    for store in ("secrets.json", *SECRET_STORES):
        path = stack / store
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, store
    files = [p for p in (*runs.rglob("*"), *stack.rglob("*")) if p.is_file()]
    files = [p for p in files if p.name not in ("secrets.json", *SECRET_STORES)]
    files += [journal, *tmp_path.glob("*.log")]
    assert len(files) > 20, files
    leaks = [
        (str(path), secret[:12])
        for path in files
        for secret in secrets
        if secret in path.read_text(errors="replace")
    ]
    assert not leaks, leaks[:10]
    assert os.environ.get("LLMCHAOS_REDIS_PASSWORD") is None
