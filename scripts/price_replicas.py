"""The layout advisor's price of replica slots for the 671B job: python -m torchtitan_ext.bench price_replicas."""
from torchtitan_ext.bench.price_replicas import main

if __name__ == "__main__":
    raise SystemExit(main())
