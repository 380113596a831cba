"""What one training step of a job pays a GPU, per MoE layer and pass: the device-cost ledger.

    python -m torchtitan_ext.ledger --job.config_file X [overrides] [--world-size N] [--moe-call] [--markdown FILE]

Runs the job's first two steps on this machine (N processes; gloo on a CPU) and counts the second under
:class:`~torchtitan_ext.measuring.device_cost_counter.DeviceCostCounter`: host syncs, host-to-device copies, collectives
(kind, group, bytes), kernel-library calls, local bytes and weight copies, per MoE layer and pass, against the
budget its backend and features declare. It counts calls, not time: a CPU run gives the counts a GPU run pays.
``--moe-call``, for a job this machine cannot run (the 671B job's 256 ranks): one MoE call of its backend at the
job's per-rank shape instead, in a process group of one (bytes extended to the job's hidden size), on the
reference kernels, whose calls declare the syncs the library makes as the library's adapters do; under expert
replication, with its split and one rank's replica weights.
Exit status 1 when a layer is over its budget.
"""

import sys
import time
from pathlib import Path

from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

with imports_without_collection():
    from torchtitan_ext.config import ConfigError, job_world_size, load_job_config, parse
    from torchtitan_ext.ep import backend_class
    from torchtitan_ext.measuring.device_ledger import count_step, format_ledger, moe_call_ledger
    from torchtitan_ext.runtime import device_type
    from torchtitan_ext.training import prepare


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--world-size", type=int, help="ranks in the job (default: NGPU, else the config's degrees)")
    parser.add_argument("--moe-call", action="store_true",
                        help="count one MoE call at the job's per-rank shape in a group of one, not a training step")
    parser.add_argument("--markdown", type=Path, help="also append the table, with the command, to this file")
    args, train_args = parser.parse_known_args(argv)
    prepare()
    device = device_type()
    try:
        world_size = job_world_size(parse(train_args), args.world_size)
        # one MoE call at a shape: the job's other sections (another backend's, say) need not be its
        job_config = parse(train_args) if args.moe_call else load_job_config(train_args, device, world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python -m torchtitan_ext.ledger " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.moe_call:
        backend = backend_class(job_config).config_section
        if backend is not None:
            getattr(job_config, backend).implementation = "reference"
        print(f"[ledger] one MoE call of the job ({world_size} ranks) at its per-rank shape, in a group of one"
              + (f", {backend} on the reference kernels" if backend else ""), flush=True)
        ledger = moe_call_ledger(job_config)
    else:
        print(f"[ledger] {world_size} processes on {device}: step 1 builds what a job builds once, step 2 is counted "
              "(under expert replication, the first step with replicas)", flush=True)
        ledger = count_step(train_args, world_size, device)
    table = format_ledger(ledger, f"Device-cost ledger ({time.strftime('%Y-%m-%d')}): `{command}`")
    print(table)
    if args.markdown is not None:
        with open(args.markdown, "a") as f:
            f.write("\n" + table)
    return 1 if ledger.over_budget() else 0


if __name__ == "__main__":
    run_and_exit(main)
