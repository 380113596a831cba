"""Supervise a job's torchrun (:class:`torchtitan_ext.launch.supervisor.Supervisor`):

    python -m torchtitan_ext.supervise [--checkpoint-folder DIR] [--dump-folder DIR] -- torchrun [torchrun args]

relays its output, forwards preemption signals to the training processes, and
ends a failed job with one line naming the rank, how it stopped, the last
step and where the same command resumes.
"""

import argparse
import sys
from pathlib import Path

from torchtitan_ext.launch.supervisor import Supervisor
from torchtitan_ext.runtime.command_line import CommandLineParser


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("--checkpoint-folder", default="", help="the job's checkpoint folder ('' when checkpointing is off)")
    parser.add_argument("--dump-folder", default="",
                        help="the job's dump folder, whose metrics.jsonl names the last step logged ('' if unknown)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("error: no command to supervise: python -m torchtitan_ext.supervise [--checkpoint-folder DIR] "
              "[--dump-folder DIR] -- torchrun ...", file=sys.stderr)
        return 2
    folder = Path(args.checkpoint_folder) if args.checkpoint_folder else None
    return Supervisor(command, folder, Path(args.dump_folder) if args.dump_folder else None).run()


if __name__ == "__main__":
    sys.exit(main())
