"""The MoE forward with the shared experts overlapping combine: python -m torchtitan_ext.bench overlap."""
from torchtitan_ext.bench.overlap import main

if __name__ == "__main__":
    raise SystemExit(main())
