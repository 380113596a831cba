"""One EP dispatch + combine per backend against its bare collectives: python -m torchtitan_ext.bench ep."""
from torchtitan_ext.bench.ep import main

if __name__ == "__main__":
    raise SystemExit(main())
