#!/usr/bin/env bash
# Launch a training job, torchtitan style.
#
#   ./run_train.sh                                  # DeepSeek-V3 debug model, EP=2
#   CONFIG_FILE=train_configs/llama4_debug_model.toml ./run_train.sh
#   ./run_train.sh --training.steps 10 --parallelism.expert_parallel_comm_backend hybridep
#   COMM_MODE=fake_backend NGPU=256 CONFIG_FILE=... ./run_train.sh   # dry run: validate, no weights
#
# Environment:
#   NGPU         processes on this machine (default: the number of GPUs, or 2 on CPU; for a dry run
#                the config's degrees, when they fix the world size)
#   CONFIG_FILE  TOML job config (default: train_configs/debug_model.toml); --job.config_file X works too
#   LOG_RANK     ranks whose output is shown, comma separated (default: the first rank that
#                computes the loss: 0, or the last pipeline stage's first rank)
#   COMM_MODE    "fake_backend": one-process dry run over a fake process group of NGPU
#                ranks (meta-device model, parallelize plan applied, report; no step)
#   MASTER_PORT  rendezvous port; unset picks a free one, so runs can share a machine
#   SHUTDOWN_TIMEOUT  seconds torchrun gives the ranks to save and exit after a stop signal (default 600)
# Extra arguments are config overrides (--section.key value), passed through.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=env.sh
source "${ROOT}/env.sh"

COMM_MODE="${COMM_MODE:-}"
case "${COMM_MODE}" in
    "" | fake_backend) ;;
    *)
        # torchtitan's local_tensor mode stops in its dataset sharding on this harness's jobs
        echo "error: COMM_MODE='${COMM_MODE}' is not a mode of this launcher: use COMM_MODE=fake_backend for a" \
            "one-process dry run, or unset COMM_MODE to train" >&2
        exit 2
        ;;
esac
# torchrun relays the ranks' logs through its own stdout: unbuffered, they reach a pipe (| tee) as they happen
export PYTHONUNBUFFERED=1
# torchrun's own default, set here so that it does not print a 4-line notice about it at every start
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --job.config_file among the overrides takes the place of CONFIG_FILE; both at once is an error
# (the config parser reports two different files in one line)
# (each argument compared whole: a value that mentions the flag is not the flag)
config_in_args=false
for arg in "$@"; do
    case "${arg}" in
        --job.config_file | --job.config_file=* | --job.config-file | --job.config-file=*) config_in_args=true ;;
    esac
done
config_args=()
if [ "${config_in_args}" = true ]; then
    [ -n "${CONFIG_FILE:-}" ] && config_args=(--job.config_file "${CONFIG_FILE}")
else
    config_args=(--job.config_file "${CONFIG_FILE:-train_configs/debug_model.toml}")
fi

for arg in "$@"; do
    case "${arg}" in
        -h | --help)
            # this launcher's usage (the comment above), then every config option, the config file's values as
            # defaults
            # (the options are read whole first, so that a reader that stops early, | head, closes the pipe on sed,
            # not on Python, which would print a traceback)
            options="$(python -m torchtitan_ext.launch.preflight --ngpu 1 -- "${config_args[@]}" "$@")"
            sed -n '2,/^set -euo pipefail$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
            echo
            printf '%s\n' "${options}" | sed '1s|^usage: [^ ]*|usage: ./run_train.sh|'
            exit 0
            ;;
    esac
done

if [ "${COMM_MODE}" = "fake_backend" ]; then
    # the world size as every tool takes it: NGPU, else the config's degrees (a dry run is for another machine)
    NGPU="${NGPU:-}" exec python -m torchtitan_ext.measuring.dry_run -- "${config_args[@]}" "$@"
fi

if [ -z "${NGPU:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        # one "GPU n:" line per device; MIG instances are listed under it, indented
        NGPU="$(nvidia-smi -L | grep -c '^GPU ')"
    else
        NGPU=2
    fi
fi

port_args=()
if [ -n "${MASTER_PORT:-}" ]; then
    port_args=(--port "${MASTER_PORT}")
    rdzv_endpoint="localhost:${MASTER_PORT}"
else
    rdzv_endpoint="localhost:0"
fi
launch_info="$(python -m torchtitan_ext.launch.preflight --ngpu "${NGPU}" "${port_args[@]}" \
    ${LOG_RANK:+--log-rank "${LOG_RANK}"} --print-launch-info -- \
    "${config_args[@]}" "$@")"
eval "${launch_info}"
# by default the log shown is the first rank that computes the loss (the last pipeline stage's)
export LOG_RANK="${LOG_RANK:-${TTE_LOSS_RANK}}"

# the supervisor relays the output, forwards SIGTERM/SIGUSR1 (preemption) to the training processes,
# and ends a failed job with one line: which rank, how, after which step, where to resume
# a preemption signal that reaches torchrun itself (a process-group kill, scancel) goes to the ranks too,
# SIGUSR1 included, and torchrun waits SHUTDOWN_TIMEOUT seconds for their checkpoint before SIGKILL
exec python -m torchtitan_ext.supervise --checkpoint-folder "${TTE_CHECKPOINT_FOLDER}" --dump-folder "${TTE_DUMP_FOLDER}" -- \
    torchrun --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="${rdzv_endpoint}" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}" \
    --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
    -m torchtitan_ext.train "${config_args[@]}" "$@"
