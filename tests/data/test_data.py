"""The embedded data builder: deterministic corpus and tokenizer, torchtitan-readable."""

import json
import threading
import types

import datasets.config
import pytest
from huggingface_hub import constants, HfApi
from huggingface_hub.errors import RepositoryNotFoundError
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

from torchtitan_ext.config import ConfigError, parse
from torchtitan_ext.data import check_dataset_folder, DATASET_NAME, ensure_assets, register_embedded_dataset
from torchtitan_ext.data.embedded import (
    CORPUS_FILE,
    EmbeddedAssets,
    MANIFEST_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    VALIDATION_DATASET_NAME,
    VALIDATION_FILE,
    VOCAB_SIZE,
    collect_documents,
    collect_splits,
    split_lines,
)


def _files(root):
    return {
        name: (root / name).read_bytes()
        for name in (CORPUS_FILE, VALIDATION_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, MANIFEST_FILE)
    }


def test_build_is_byte_identical(tmp_path):
    first = ensure_assets(tmp_path / "a").root
    second = ensure_assets(tmp_path / "b").root
    assert _files(first) == _files(second)
    manifest = json.loads((first / MANIFEST_FILE).read_text())
    assert manifest["vocab_size"] == VOCAB_SIZE
    assert manifest["corpus_bytes"] >= 2_000_000
    documents = [json.loads(line) for line in (first / CORPUS_FILE).read_text().splitlines()]
    sources = [d["source"] for d in documents]
    assert sources != sorted(sources), "documents are shuffled"


def test_sources_sorted_and_tests_excluded(tmp_path):
    stdlib = tmp_path / "lib"
    for rel in ("zeta.py", "alpha/b.py", "alpha/a.py", "test/test_x.py", "pkg/tests/t.py"):
        (stdlib / rel).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / rel).write_text(f"# {rel}\r\nx = 1\n")
    documents = collect_documents(stdlib, max_bytes=10**6)
    assert sorted(d["source"] for d in documents) == ["alpha/a.py:0", "alpha/b.py:0", "zeta.py:0"]
    assert all("\r" not in d["text"] for d in documents)
    assert [d["source"] for d in collect_documents(stdlib, max_bytes=1)] == ["alpha/a.py:0"]


def test_the_validation_split_holds_the_source_files_that_follow_the_corpus(tmp_path):
    """Whole files after the corpus's last one, never one of the corpus's; a build from before the split is
    incomplete (built again on first use)."""
    stdlib = tmp_path / "lib"
    for rel in ("a.py", "b.py", "c.py", "d.py"):
        (stdlib / rel).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / rel).write_text(f"# {rel}\n" + "x = 1\n" * 20)
    size = len((stdlib / "a.py").read_bytes())
    corpus, validation = collect_splits(stdlib, max_bytes=size + 1, validation_bytes=size)
    assert sorted(d["source"] for d in corpus) == ["a.py:0", "b.py:0"]
    assert [d["source"] for d in validation] == ["c.py:0"]
    old_build = EmbeddedAssets(tmp_path / "old")
    old_build.root.mkdir()
    old_build.manifest.write_text("{}")
    assert old_build.is_build() and not old_build.is_complete()


def test_documents_are_whole_lines_within_size():
    text = "".join(f"line {i:04d} " + "x" * (i % 50) + "\n" for i in range(400))
    pieces = split_lines(text, max_bytes=512)
    assert "".join(pieces) == text
    assert all(len(p.encode()) <= 512 and p.endswith("\n") for p in pieces)
    assert split_lines("y" * 600 + "\nz\n", max_bytes=512) == ["y" * 600 + "\n", "z\n"]


def test_concurrent_builds_produce_one_complete_directory(tmp_path):
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    for i in range(20):
        (stdlib / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 50)
    target = tmp_path / "assets"
    threads = [threading.Thread(target=ensure_assets, args=(target, stdlib)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [CORPUS_FILE, MANIFEST_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, VALIDATION_FILE]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]


def test_tokenizer_loads_in_torchtitan(embedded_assets):
    tokenizer = HuggingFaceTokenizer(str(embedded_assets.root))
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == 1
    assert tokenizer.decode(ids[1:-1]) == text
    assert max(ids) < VOCAB_SIZE


def test_dataset_registered_and_split_across_ranks(embedded_assets):
    register_embedded_dataset()
    tokenizer = HuggingFaceTokenizer(str(embedded_assets.root))
    samples = []
    for rank in range(2):
        dataset = HuggingFaceTextDataset(
            DATASET_NAME, str(embedded_assets.root), tokenizer, seq_len=64, dp_rank=rank, dp_world_size=2
        )
        inputs, labels = next(iter(dataset))
        assert inputs["input"].shape == labels.shape == (64,)
        assert int(inputs["input"].max()) < VOCAB_SIZE
        samples.append(inputs["input"])
    assert not samples[0].equal(samples[1])
    held_out = HuggingFaceTextDataset(VALIDATION_DATASET_NAME, str(embedded_assets.root), tokenizer, seq_len=64)
    assert not next(iter(held_out))[0]["input"].equal(samples[0])
    manifest = json.loads(embedded_assets.manifest.read_text())
    assert manifest["validation_documents"] > 0 and not set(manifest["sources"]) & set(manifest["validation_sources"])


def test_a_hub_dataset_is_refused_only_where_neither_the_hub_nor_a_cache_gives_it(monkeypatch, tmp_path):
    """The Hub unreachable (a network error from huggingface_hub's client) and no cache: refused in one line; a copy
    in either Hugging Face cache, or any answer of the Hub (a dataset it does not have), leaves it to HF datasets."""
    job_config = parse(["--job.config_file", "train_configs/debug_model.toml", "--training.dataset", "c4"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")

    def unreachable(self, name, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", unreachable)
    with pytest.raises(ConfigError, match=r"^training.dataset = 'c4' loads 'allenai/c4' from the Hugging Face Hub, "
                                          r"which this machine cannot reach \(OSError: \[Errno -2\] Name or service "
                                          r"not known\), and no Hugging Face cache here holds it: "):
        check_dataset_folder(job_config)
    for cached in (tmp_path / "hub" / "datasets--allenai--c4", tmp_path / "datasets" / "allenai___c4"):
        cached.mkdir(parents=True)
        check_dataset_folder(job_config)
        cached.rmdir()

    def not_on_the_hub(self, name, **kwargs):  # the Hub's 404, its response reduced to what the error reads
        raise RepositoryNotFoundError(f"{name} not found", response=types.SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr(HfApi, "dataset_info", not_on_the_hub)
    check_dataset_folder(job_config)
    relative = parse(["--job.config_file", "train_configs/debug_model.toml", "--training.dataset", "c4",
                      "--training.dataset_path", "./c4"])  # a folder's path, though owner/name in form
    with pytest.raises(ConfigError, match=r"^training.dataset_path = './c4' \(relative to .*\) is not a folder here"):
        check_dataset_folder(relative)
