#!/usr/bin/env bash
# Tensor parallelism does not change training: for every backend, NGPU=4 with
# tensor_parallel_degree 2 against NGPU=2 (the same global batch: dp_shard 2 in
# both), fp32, deterministic, 5 steps, both from one seed checkpoint made with
# NGPU=1 (so that the initial weights do not depend on the mesh). Prints each
# run's losses (its metrics.jsonl) and the largest relative difference per backend (goal <= 1e-4).
#
#   ./scripts/check_tp_parity.sh [work folder, default /tmp/tp_parity]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
WORK="${1:-/tmp/tp_parity}"
COMMON=(--training.steps 5 --training.mixed_precision_param float32 --debug.deterministic
        --training.seq_len 64 --training.local_batch_size 2)
# the folder is emptied: only one this script made (its marker file), a new one or an empty one
if [ -z "${WORK}" ] || { [ -e "${WORK}" ] && [ -n "$(ls -A "${WORK}" 2>/dev/null)" ] \
        && [ ! -f "${WORK}/.check_tp_parity" ]; }; then
    echo "error: work folder '${WORK}' is not empty and was not made by this script: pass a new or empty folder" >&2
    exit 2
fi
rm -rf "${WORK}" && mkdir -p "${WORK}" && touch "${WORK}/.check_tp_parity"
# shellcheck source=../env.sh
source "${ROOT}/env.sh"
# every variant the reference kernels run, from the package's backend table
VARIANTS=($(python -c "from torchtitan_ext.ep.backends import CPU_VARIANTS; print(*CPU_VARIANTS)"))
# a backend variant's overrides, from the package's one table of them
variant_args() { python -c 'import sys; from torchtitan_ext.ep.backends import backend_variants
print(*backend_variants()[sys.argv[1]])' "$1"; }
# the losses a run logged in its dump folder
losses() { python -c 'import sys; from torchtitan_ext.metrics_file import logged_losses
print(*(loss for _, loss in sorted(logged_losses(sys.argv[1]).items())))' "$1"; }
NGPU=1 ./run_train.sh "${COMMON[@]}" --parallelism.expert_parallel_degree 1 --checkpoint.enable \
    --checkpoint.create_seed_checkpoint --job.dump_folder "${WORK}/seed" > "${WORK}/seed.log" 2>&1
for name in "${VARIANTS[@]}"; do
    for ngpu in 2 4; do
        extra=()
        [ "${ngpu}" = 4 ] && extra=(--parallelism.tensor_parallel_degree 2)
        run="${WORK}/${name}-${ngpu}"
        mkdir -p "${run}/checkpoint" && cp -r "${WORK}/seed/checkpoint/step-0" "${run}/checkpoint/"
        # shellcheck disable=SC2046  # the variant's overrides, one word each
        NGPU=${ngpu} ./run_train.sh "${COMMON[@]}" $(variant_args "${name}") "${extra[@]}" --checkpoint.enable \
            --checkpoint.interval 100 --job.dump_folder "${run}" > "${run}.log" 2>&1
        echo "${name} NGPU=${ngpu}: $(losses "${run}")"
    done
    python - "$(losses "${WORK}/${name}-2")" "$(losses "${WORK}/${name}-4")" "${name}" <<'PY'
import sys
a, b = ([float(x) for x in arg.split()] for arg in sys.argv[1:3])
assert len(a) == len(b) == 5, (a, b)
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
verdict = "within" if worst <= 1e-4 else "OVER"
print(f"{sys.argv[3]}: largest relative difference over 5 steps {worst:.2e} ({verdict} 1e-4)")
PY
done
