"""The default job's step time on a CPU without bf16 units: python -m torchtitan_ext.bench cpu_precision."""
from torchtitan_ext.bench.cpu_precision import main

if __name__ == "__main__":
    raise SystemExit(main())
