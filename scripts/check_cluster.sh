#!/usr/bin/env bash
# The first command to run on a CUDA machine: real deep_ep kernels, benchmarks and a short training
# per backend, in one markdown report: python -m torchtitan_ext.bench cluster_check (its --help says what it runs).
#
#   ./scripts/check_cluster.sh [--report outputs/cluster_check.md] [--steps 10] [--skip-training]
#
# Without CUDA it lists the prerequisites it can check, says what it cannot, and exits 0.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../env.sh
source "${ROOT}/env.sh"
cd "${ROOT}"
exec python -m torchtitan_ext.bench cluster_check "$@"
