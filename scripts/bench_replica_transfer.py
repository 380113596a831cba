"""Expert replication's transfers alone: python -m torchtitan_ext.bench replica_transfer."""
from torchtitan_ext.bench.replica_transfer import main

if __name__ == "__main__":
    raise SystemExit(main())
