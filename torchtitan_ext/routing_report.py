"""Plots of saved routing statistics: ``python -m torchtitan_ext.routing_report DUMP [--layer L] [--out DIR]``.

``DUMP`` is a folder of ``routing_step*.npz`` files (``<dump_folder>/routing_stats``)
or one file. Writes ``expert_load.png`` and ``coactivation_layer<L>.png``
(:mod:`torchtitan_ext.balancing.routing_report`) next to the data unless
``--out`` says otherwise. Needs the ``plots`` extra (matplotlib).
"""

import sys
from pathlib import Path

from torchtitan_ext.balancing.routing_stats import load_path
from torchtitan_ext.config import ConfigError
from torchtitan_ext.runtime.command_line import CommandLineParser


def main(argv: list[str] | None = None) -> list[Path]:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("dump", type=Path, help="routing_stats folder or one .npz file")
    parser.add_argument("--layer", type=int, help="layer for the co-activation plot (default: most imbalanced)")
    parser.add_argument("--out", type=Path, help="output folder (default: the dump folder)")
    args = parser.parse_args(argv)
    try:
        try:
            from torchtitan_ext.balancing.routing_report import most_imbalanced_layer, write_report
        except ModuleNotFoundError as e:
            raise ConfigError(f"the routing report needs matplotlib ({e}): pip install -e '.[plots]'") from None
        stats = load_path(args.dump)
        layer = most_imbalanced_layer(stats) if args.layer is None else args.layer
        if layer not in stats["layers"]:
            raise ConfigError(f"--layer {layer} is not a MoE layer of {args.dump}: use one of {stats['layers'].tolist()}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    written = write_report(stats, args.out or (args.dump.parent if args.dump.is_file() else args.dump), layer)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
