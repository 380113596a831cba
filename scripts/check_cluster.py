"""The first check on a CUDA machine: python -m torchtitan_ext.bench cluster_check (check_cluster.sh runs it)."""
from torchtitan_ext.bench.cluster_check import main

if __name__ == "__main__":
    raise SystemExit(main())
