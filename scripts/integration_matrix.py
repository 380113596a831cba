"""torchtitan 0.2.2's integration combinations per backend: python -m torchtitan_ext.bench integration_matrix."""
from torchtitan_ext.bench.integration_matrix import main

if __name__ == "__main__":
    raise SystemExit(main())
