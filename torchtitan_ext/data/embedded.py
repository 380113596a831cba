"""The embedded default corpus and tokenizer, built from the Python standard library.

Nothing is downloaded: the corpus is the source code of the running
interpreter's standard library (test suites excluded), taken file by file in
sorted path order until ``CORPUS_BYTES`` bytes, cut at line boundaries into
documents of at most ``DOCUMENT_BYTES`` bytes and shuffled with a fixed seed
(so that consecutive batches mix many modules rather than walking through one
large file). The files that follow, until ``VALIDATION_BYTES`` more, are the
held-out validation split (``validation.jsonl``, the dataset
``VALIDATION_DATASET_NAME``): no source file is in both, and the tokenizer, a
byte-level BPE with ``VOCAB_SIZE`` entries trained with Hugging Face
``tokenizers``, sees the training corpus only. The same interpreter gives byte-identical assets;
``manifest.json`` records the sources and the SHA-256 of each file built.

Builds are atomic (a temporary directory renamed into place under a file lock),
so several ranks that start at once build the assets once and never read a
half-written file.
"""

import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import decoders, models, pre_tokenizers, trainers, Tokenizer
from torchtitan.tools.logging import logger

DATASET_NAME = "stdlib_code"
"""Dataset name to put in ``[training] dataset``."""

DEFAULT_ASSETS_DIR = Path("assets") / "embedded"
"""Where the default config expects the assets, relative to the working directory."""

VALIDATION_DATASET_NAME = "stdlib_code_validation"
"""Dataset name of the held-out split, for ``[validation] dataset``."""

CORPUS_FILE = "corpus.jsonl"
VALIDATION_FILE = "validation.jsonl"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MANIFEST_FILE = "manifest.json"

CORPUS_BYTES = 2_000_000
"""Size of the corpus: about 600k tokens, enough for hundreds of debug steps."""

VALIDATION_BYTES = 200_000
"""Where the held-out split ends, counted past ``CORPUS_BYTES``: the training corpus's last file overruns into it, so
the split is a little smaller (171 kB, about 50k tokens, with CPython 3.11's library)."""

DOCUMENT_BYTES = 4096
"""Largest document; a source file is cut at line boundaries into pieces this size."""

SHUFFLE_SEED = 0

VOCAB_SIZE = 2048
"""Matches the debug flavours' vocabulary (vocab_size=2048): every debug flavour of DeepSeek-V3, Llama4 and Qwen3,
and GPT-OSS's ``debugmodel_small`` (its ``debugmodel`` keeps GPT-OSS's 201,088-token vocabulary)."""

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclass(frozen=True)
class EmbeddedAssets:
    """Paths of a built asset directory."""

    root: Path

    @property
    def corpus(self) -> Path:
        return self.root / CORPUS_FILE

    @property
    def validation(self) -> Path:
        return self.root / VALIDATION_FILE

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_FILE

    def is_build(self) -> bool:
        """Whether the folder holds a build (the manifest is written last), this version's or an earlier one."""
        return self.manifest.is_file()

    def is_complete(self) -> bool:
        """Whether it holds this version's build: one from before the validation split has none, and
        :func:`ensure_assets` builds it again."""
        return self.is_build() and self.validation.is_file()


def stdlib_sources(stdlib_dir: Path | None = None) -> list[Path]:
    """Standard-library ``.py`` files in sorted order, test suites excluded."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts)
    )


def split_lines(text: str, max_bytes: int = DOCUMENT_BYTES) -> list[str]:
    """Consecutive runs of whole lines, each at most ``max_bytes`` (a longer line stands alone)."""
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        line_bytes = len(line.encode("utf-8"))
        if current and size + line_bytes > max_bytes:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += line_bytes
    if current:
        pieces.append("".join(current))
    return pieces


def collect_splits(
    stdlib_dir: Path | None = None, max_bytes: int = CORPUS_BYTES, validation_bytes: int = VALIDATION_BYTES
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(corpus, validation): the shuffled documents ``{"source": "relative/path.py:piece", "text": ...}`` of the
    first source files until ``max_bytes``, and of the files that follow until ``validation_bytes`` more."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    splits, total = ([], []), 0
    for path in stdlib_sources(root):
        if total >= max_bytes + validation_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        source = path.relative_to(root).as_posix()
        splits[total >= max_bytes].extend(
            {"source": f"{source}:{i}", "text": piece}
            for i, piece in enumerate(split_lines(text))
        )
        total += len(text.encode("utf-8"))
    for documents in splits:
        random.Random(SHUFFLE_SEED).shuffle(documents)
    return splits


def collect_documents(stdlib_dir: Path | None = None, max_bytes: int = CORPUS_BYTES) -> list[dict[str, str]]:
    """The training corpus of :func:`collect_splits`."""
    return collect_splits(stdlib_dir, max_bytes, 0)[0]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE; ids 0 and 1 are BOS and EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_documents(path: Path, documents: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n")


def _write_assets(target: Path, documents: list[dict[str, str]], validation: list[dict[str, str]]) -> None:
    _write_documents(target / CORPUS_FILE, documents)
    _write_documents(target / VALIDATION_FILE, validation)
    tokenizer = train_tokenizer([d["text"] for d in documents])
    (target / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    (target / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(
            {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True},
            indent=2,
        ),
        encoding="utf-8",
    )
    manifest = {
        "python": sys.version.split()[0],
        "documents": len(documents),
        "corpus_bytes": sum(len(d["text"].encode("utf-8")) for d in documents),
        "vocab_size": tokenizer.get_vocab_size(),
        "sources": sorted({d["source"].rpartition(":")[0] for d in documents}),
        "validation_documents": len(validation),
        "validation_sources": sorted({d["source"].rpartition(":")[0] for d in validation}),
        "sha256": {
            name: _sha256(target / name)
            for name in (CORPUS_FILE, VALIDATION_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
        },
    }
    (target / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def ensure_assets(
    root: Path | str = DEFAULT_ASSETS_DIR, stdlib_dir: Path | None = None
) -> EmbeddedAssets:
    """Build the corpus and tokenizer into ``root`` unless already there."""
    assets = EmbeddedAssets(Path(root))
    if assets.is_complete():
        return assets
    assets.root.parent.mkdir(parents=True, exist_ok=True)
    lock_path = assets.root.parent / f".{assets.root.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not assets.is_complete():
            if assets.root.exists():
                shutil.rmtree(assets.root)
            logger.info(
                f"Building the embedded corpus and tokenizer in {assets.root} from this Python's standard library "
                "(first use only; 12 s on a 2-core CPU)"
            )
            began = time.perf_counter()
            staging = Path(tempfile.mkdtemp(dir=assets.root.parent, prefix=".staging-"))
            try:
                _write_assets(staging, *collect_splits(stdlib_dir))
                os.rename(staging, assets.root)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            logger.info(f"Built the embedded corpus and tokenizer in {time.perf_counter() - began:.0f} s")
    return assets


def load_documents(root: Path | str, validation: bool = False) -> list[dict[str, str]]:
    """Documents of a built corpus (``validation``: of its held-out split), in file order."""
    assets = EmbeddedAssets(Path(root))
    with open(assets.validation if validation else assets.corpus, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
