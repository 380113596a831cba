"""Build the embedded corpus and tokenizer: ``python -m torchtitan_ext.data [DIR]``."""

import json

from torchtitan_ext.runtime.command_line import CommandLineParser

from .embedded import DEFAULT_ASSETS_DIR, ensure_assets


def main() -> None:
    parser = CommandLineParser(description=__doc__)
    parser.add_argument("root", nargs="?", default=str(DEFAULT_ASSETS_DIR))
    args = parser.parse_args()
    assets = ensure_assets(args.root)
    manifest = json.loads(assets.manifest.read_text())
    print(
        f"embedded assets in {assets.root}: {manifest['documents']} documents, "
        f"{manifest['corpus_bytes']:,} bytes, {manifest['validation_documents']} held out for validation, "
        f"vocab {manifest['vocab_size']} (python {manifest['python']})"
    )


if __name__ == "__main__":
    main()
