#!/usr/bin/env bash
# Run the test suite: ./test.sh [pytest args]
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
exec python -m pytest "$@"
