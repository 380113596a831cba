#!/usr/bin/env bash
# Run the test suite: ./test.sh [--fast] [pytest args]
#   --fast   only the tests that start no process and run no training job (25 s to 2 minutes; not -m slow)
# Sets up the environment on first use (see env.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
source "${ROOT}/env.sh"
cd "${ROOT}"
# an environment set up before pytest-xdist joined the test extras would stop at pytest's "-n" option
if ! python -c "import xdist" >/dev/null 2>&1; then
    echo "error: pytest-xdist is missing (the suite runs its files in parallel): \"${TTE_PYTHON}\" -m pip install -e \"${ROOT}[test]\"" >&2
    exit 2
fi
args=()
for arg in "$@"; do
    if [ "${arg}" = "--fast" ]; then
        args+=(-m "not slow")
    else
        args+=("${arg}")
    fi
done
exec python -m pytest ${args[@]+"${args[@]}"}
