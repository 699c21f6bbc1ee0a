#!/usr/bin/env bash
# LiteLLM proxy (pinned, every package by hash) in its own venv for the hosts target's LiteLLM
# example. Why a venv of its own and why this version: the header of
# scripts/litellm-requirements.txt. Installed by .venv's uv through scripts/uv (the Makefile
# says why uv), its cache in ~/.cache/llmchaos/uv.
#
# The venv is built once per lock file in the build cache, ~/.cache/llmchaos/litellm/<lock
# checksum>/, and .venv-litellm links to it: a fresh clone on a machine that has it is ready
# at once instead of after 20 s of installing 760 MB (a venv cannot be moved, so it is built
# where it stays; a stamp holding the lock's checksum, written last, marks it complete). Safe
# to run again, and from two clones at once (a lock file serializes the installs). Installing
# one removes the venvs of other lock files that no clone has linked for a week.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LINK=.venv-litellm
LOCK=scripts/litellm-requirements.txt
CACHE=$HOME/.cache/llmchaos/litellm
want=$(sha256sum "$LOCK" | cut -d' ' -f1)
key=${want:0:16}  # the venv's folder name
VENV=$CACHE/$key
STAMP=$VENV/.installed-stamp

# its interpreter too: a venv whose system Python was upgraded away is built again
installed() { [[ -x $VENV/bin/python && -x $VENV/bin/litellm && -f $STAMP && $(cat "$STAMP") == "$want" ]]; }

if ! installed; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  if ! flock -w 600 9; then
    echo "install-litellm: another install has held $CACHE/.lock for 10 minutes" >&2
    exit 1
  fi
  if ! installed; then  # another clone may have installed it while this one waited
    UV=scripts/uv  # .venv's, with the project's settings
    echo "installing LiteLLM into $VENV (760 MB: 20 s from uv's cache, a minute or two without)"
    rm -rf "$VENV"  # a half-built one: no stamp
    "$PYTHON" -m venv --without-pip "$VENV"
    "$UV" pip install -q --python "$VENV/bin/python" --compile-bytecode --require-hashes --no-deps -r "$LOCK"
    "$UV" pip check -q --python "$VENV/bin/python"
    echo "$want" > "$STAMP"
    # venvs of other lock files that no clone has linked for a week (a link touches its venv)
    find "$CACHE" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -mtime +7 -exec rm -rf {} +
  fi
  exec 9>&-
fi
# a venv of its own from before the cache: replaced by the link
if [[ -d $LINK && ! -L $LINK ]]; then
  rm -rf "$LINK"
fi
ln -sfn "$VENV" "$LINK"
touch "$VENV"
