#!/usr/bin/env bash
# Run the test suite: ./scripts/test.sh [pytest args]
# Sets up the environment on first use (see scripts/env.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=env.sh
source "${ROOT}/scripts/env.sh"
cd "${ROOT}"
exec python -m pytest "$@"
