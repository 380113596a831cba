"""Expert placement on this machine: record, place, resume: python -m torchtitan_ext.bench placement_check."""
from torchtitan_ext.bench.placement_check import main

if __name__ == "__main__":
    raise SystemExit(main())
