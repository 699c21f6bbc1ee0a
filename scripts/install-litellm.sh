#!/usr/bin/env bash
# LiteLLM proxy (pinned, every package by hash) in its own venv, .venv-litellm/, for the hosts
# target's LiteLLM example. Why a venv of its own and why this version: the header of
# scripts/litellm-requirements.txt. Installed by .venv's uv through scripts/uv (the Makefile
# says why uv), its cache in ~/.cache/llmchaos/uv. Safe to run again: nothing is done when the
# installed set matches the lock file (a stamp holds the lock's checksum).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-litellm
LOCK=scripts/litellm-requirements.txt
STAMP=$VENV/.installed-stamp
want=$(sha256sum "$LOCK" | cut -d' ' -f1)
if [[ -x $VENV/bin/litellm && -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
  exit 0
fi
UV=scripts/uv  # .venv's, with the project's settings
echo "installing LiteLLM into $VENV (760 MB: 20 s from uv's cache, a minute or two without)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv --without-pip "$VENV"
"$UV" pip install -q --python "$VENV/bin/python" --compile-bytecode --require-hashes --no-deps -r "$LOCK"
"$UV" pip check -q --python "$VENV/bin/python"
echo "$want" > "$STAMP"
