"""A training step, ours against upstream torchtitan's ExpertParallel: python -m torchtitan_ext.bench step."""
from torchtitan_ext.bench.step import main

if __name__ == "__main__":
    raise SystemExit(main())
