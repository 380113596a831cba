"""The layout advisor against runs on this machine: python -m torchtitan_ext.bench layout_advisor_check."""
from torchtitan_ext.bench.layout_advisor_check import main

if __name__ == "__main__":
    raise SystemExit(main())
