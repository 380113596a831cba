"""Expert placement from recorded routing:

    python -m torchtitan_ext.placement --routing-stats DUMP --job.config_file X [overrides]
        [--world-size N] [--ranks-per-domain D] [--first-step S] [--holdout F] [--load-tolerance T]
        [-o placement.json]

writes a placement file (:mod:`torchtitan_ext.balancing.placement`) that
``--expert_placement.file`` trains with; the search and its report are
:mod:`torchtitan_ext.balancing.placement_search`.
"""

import sys

from torchtitan_ext.runtime.command_line import CommandLineParser
from torchtitan_ext.runtime.entry import imports_without_collection, run_and_exit

with imports_without_collection():
    from torchtitan_ext.balancing.placement_search import check_search_options, search
    from torchtitan_ext.config import ConfigError, job_world_size, load_job_config, parse
    from torchtitan_ext.training import prepare


def main(argv: list[str] | None = None) -> None:
    parser = CommandLineParser(
        description="Expert placement from recorded routing (see torchtitan_ext/balancing/placement_search.py)",
        epilog="Other arguments are the job's config overrides (--job.config_file X, --section.key value).",
    )
    parser.add_argument("--routing-stats", required=True, help="routing-statistics folder of a run ([routing_stats])")
    parser.add_argument("--world-size", type=int, help="processes of the job that will use the placement (default: NGPU, else the config's degrees)")
    parser.add_argument("--ranks-per-domain", type=int,
                        help="EP ranks per NVLink domain (default: the backend's configured domain, else all EP ranks)")
    parser.add_argument("--first-step", type=int, default=1, help="use the dump's files from this training step on")
    parser.add_argument("--holdout", type=float, default=0.5, help="fraction of the dump's files (the last ones) held out for evaluation, in (0, 1)")
    parser.add_argument("--load-tolerance", type=float, default=0.02,
                        help="how far over the balanced placement's largest rank load grouping may go, as a fraction >= 0")
    parser.add_argument("-o", "--output", default="placement.json", help="placement file to write")
    args, train_args = parser.parse_known_args(argv)
    try:
        check_search_options(args.holdout, args.load_tolerance, args.first_step, args.ranks_per_domain)
        prepare()
        world_size = job_world_size(parse(train_args), args.world_size)
        job_config = load_job_config(train_args, device_type=None, world_size=world_size)
        lines = search(
            job_config, args.routing_stats, args.output, world_size=world_size,
            ranks_per_domain=args.ranks_per_domain, first_step=args.first_step, holdout=args.holdout,
            load_tolerance=args.load_tolerance,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    run_and_exit(main)
