"""Expert replication's per-step split at scale: python -m torchtitan_ext.bench replica_split."""
from torchtitan_ext.bench.replica_split import main

if __name__ == "__main__":
    raise SystemExit(main())
