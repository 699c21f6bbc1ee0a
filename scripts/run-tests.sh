#!/usr/bin/env bash
# `make test`'s two pytest sessions side by side: the framework's tests (output here, live)
# and the catalogue as a resilience suite (output to reports/suite-output.log, printed at the
# end). Most of a chaos run's time is waiting for warm-up, windows and SLAs, so on two cores
# the two together take about as long as the longer one. Fails when either fails, pytest's
# exit code 5 (nothing collected) included. SIGINT/SIGTERM stop both; each stops what it
# started (conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p reports
suite_log=reports/suite-output.log

"$PYTHON" -m pytest tests &
tests=$!
"$PYTHON" -m pytest suites -m resilience >"$suite_log" 2>&1 &
suite=$!
echo "run-tests: pytest tests (pid $tests) and pytest suites -m resilience (pid $suite, output in $suite_log)"

interrupted=0
stop() {
    interrupted=1
    kill -TERM "$tests" "$suite" 2>/dev/null
}
trap stop INT TERM

# `wait` returns early when a trapped signal arrives: wait again until each has ended.
wait_for() {
    local pid=$1 rc
    while true; do
        wait "$pid"
        rc=$?
        kill -0 "$pid" 2>/dev/null || return "$rc"
    done
}
wait_for "$tests"
tests_rc=$?
wait_for "$suite"
suite_rc=$?

echo "== pytest suites -m resilience (from $suite_log)"
cat "$suite_log"
echo "run-tests: pytest tests exit $tests_rc, pytest suites exit $suite_rc"
if ((interrupted)); then
    exit 130
fi
if ((tests_rc != 0)); then
    exit "$tests_rc"
fi
exit "$suite_rc"
