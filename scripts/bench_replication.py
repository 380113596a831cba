"""Expert replication on the default job: python -m torchtitan_ext.bench replication."""
from torchtitan_ext.bench.replication import main

if __name__ == "__main__":
    raise SystemExit(main())
