"""The benchmarks and checks: one module each, run as ``python -m torchtitan_ext.bench NAME [args]``.

``python -m torchtitan_ext.bench --help`` lists them, ``python -m torchtitan_ext.bench NAME --help`` says what NAME
measures or checks and how. Each module's ``main(argv)`` returns the exit status. The benchmarks that time runs
record their results as a campaign under benchmarks/ (``--campaign``); docs/benchmarks.md says what they found.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout the tools run in: the repository root above this package (run_train.sh, train_configs/,
benchmarks/)."""
