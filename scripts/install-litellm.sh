#!/usr/bin/env bash
# LiteLLM proxy (pinned, every package by hash) in its own venv, .venv-litellm/, for the hosts
# target's LiteLLM example. Why a venv of its own and why this version: the header of
# scripts/litellm-requirements.txt. Safe to run again: nothing is done when the installed set
# matches the lock file (a stamp holds the lock's checksum).
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
echo "installing LiteLLM into $VENV (about 1.5 min, 760 MB)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --require-hashes --no-deps -r "$LOCK"
"$VENV/bin/python" -m pip check >/dev/null
echo "$want" > "$STAMP"
