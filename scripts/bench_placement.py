"""The placement tool on a 671B-shaped synthetic skew: python -m torchtitan_ext.bench placement."""
from torchtitan_ext.bench.placement import main

if __name__ == "__main__":
    raise SystemExit(main())
