"""Embedded default data: a corpus and tokenizer built from local text, no network.

Owns: the embedded corpus, its held-out validation split and tokenizer
(:mod:`.embedded`), their entries in torchtitan's dataset registry, and the
check of the datasets a job reads, for training and, where it validates, for
validation (registered with :mod:`torchtitan_ext.config` on import).

May import: :mod:`torchtitan_ext.config`, :mod:`torchtitan_ext.runtime` (see the tiers in :mod:`torchtitan_ext`).
"""

import difflib
import os
from pathlib import Path

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import build_text_dataloader, DATASETS
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_ext.config import ConfigError, register_check, ValidationContext
from torchtitan_ext.runtime.console import quiet

from .embedded import (
    DATASET_NAME,
    DEFAULT_ASSETS_DIR,
    EmbeddedAssets,
    ensure_assets,
    load_documents,
    VALIDATION_DATASET_NAME,
)

__all__ = [
    "check_dataset_folder",
    "check_dataset_options",
    "check_tokenizer_folder",
    "DATASET_NAME",
    "DEFAULT_ASSETS_DIR",
    "EmbeddedAssets",
    "ensure_assets",
    "register_embedded_dataset",
    "prepare_embedded_assets",
    "VALIDATION_DATASET_NAME",
]

EMBEDDED = {"training": DATASET_NAME, "validation": VALIDATION_DATASET_NAME}
"""The embedded dataset of each section that names a dataset: the corpus, and its held-out split."""


def _load_embedded_corpus(path: str) -> Dataset:
    return Dataset.from_list(load_documents(ensure_assets(path).root))


def _load_embedded_validation(path: str) -> Dataset:
    return Dataset.from_list(load_documents(ensure_assets(path).root, validation=True))


def register_embedded_dataset() -> None:
    """Add the embedded corpus and its held-out split to torchtitan's dataset registry (idempotent)."""
    for name, loader in ((DATASET_NAME, _load_embedded_corpus), (VALIDATION_DATASET_NAME, _load_embedded_validation)):
        DATASETS[name] = DatasetConfig(
            path=str(DEFAULT_ASSETS_DIR),
            loader=loader,
            sample_processor=lambda sample: sample["text"],
        )


def _sections_read(job_config) -> list[tuple[str, object]]:
    """(name, section) of each config section whose dataset the job reads: training's, and validation's where the
    job validates."""
    return [("training", job_config.training)] + (
        [("validation", job_config.validation)] if job_config.validation.enable else [])


def _embedded_roots(job_config) -> set[Path]:
    """The folders of embedded assets a job refers to: an embedded dataset's, and a ``model.hf_assets_path`` that
    points at one or at the default folder."""
    roots = set()
    for _, section in _sections_read(job_config):
        if section.dataset in EMBEDDED.values():
            roots.add(Path(section.dataset_path or DEFAULT_ASSETS_DIR).resolve())
    tokenizer_dir = Path(job_config.model.hf_assets_path).resolve()
    if tokenizer_dir in roots or tokenizer_dir == DEFAULT_ASSETS_DIR.resolve():
        roots.add(tokenizer_dir)
    return roots


def prepare_embedded_assets(job_config) -> None:
    """Build the embedded assets a job refers to (:func:`_embedded_roots`) before any rank reads them: the trainer
    loads the tokenizer before the dataset, so the assets must exist when it starts."""
    for root in sorted(_embedded_roots(job_config)):
        ensure_assets(root)


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
"""The files torchtitan's ``HuggingFaceTokenizer`` builds a tokenizer from, any one of them
(torchtitan/components/tokenizer.py)."""


def check_tokenizer_folder(job_config) -> None:
    """ConfigError where a job that is about to train has no tokenizer in ``model.hf_assets_path``: torchtitan's
    trainer loads it there in every rank (where the model's train spec builds one), once the processes have
    started, a traceback per rank. The embedded assets' folder passes: :func:`prepare_embedded_assets` builds it
    before the ranks start. For the launchers' pre-flight on the machines that train, and plan's --measure-compute,
    which trains the job here; not for a dry run or a plan, whose job may read its assets elsewhere."""
    path = job_config.model.hf_assets_path
    folder = Path(path)
    if get_train_spec(job_config.model.name).build_tokenizer_fn is None or folder.resolve() in _embedded_roots(job_config):
        return
    fix = ("put the model's tokenizer files (tokenizer.json and tokenizer_config.json, from its Hugging Face "
           "repository) there, or set model.hf_assets_path to the folder that holds them")
    if folder.is_file():
        raise ConfigError(f"model.hf_assets_path = '{path}' is a file, and the job loads its tokenizer from a folder: "
                          "set model.hf_assets_path to the folder that holds it")
    if not folder.is_dir():
        raise ConfigError(f"model.hf_assets_path = '{path}' does not exist, and the job loads its tokenizer from it: "
                          f"{fix}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.hf_assets_path = '{path}' holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                          f"{fix}")


def check_dataset_options(job_config, context: ValidationContext) -> None:
    """ConfigError where a job names a dataset torchtitan's registry does not hold, or points an embedded dataset at a
    path it would silently ignore, for training and, where the job validates, for validation.

    torchtitan's text dataloader (the text models' train specs) looks the dataset up in every rank, once they have
    started; a module that ``experimental.custom_import`` names may add to the registry when the trainer imports it,
    so such a job's names are left to it, as are another model's (its train spec has its own datasets). The embedded
    corpus is built from the interpreter's standard library into ``./assets/embedded``; a ``dataset_path`` is
    accepted only where such a build already is, so that ``--training.dataset_path /data/c4`` without
    ``--training.dataset c4`` is not trained on stdlib sources without a word.
    The same on every machine and model: ``context`` does not matter.
    """
    known = sorted({*DATASETS, *EMBEDDED.values()})
    for name, section in _sections_read(job_config):
        if _reads_the_registry(job_config) and section.dataset not in known:
            close = difflib.get_close_matches(section.dataset, known, n=1)
            raise ConfigError(
                f"{name}.dataset = '{section.dataset}' is not in torchtitan's dataset registry: "
                + (f"did you mean '{close[0]}'? " if close else "")
                + f"use one of {', '.join(known)}, or register yours in a module experimental.custom_import names"
            )
        path = section.dataset_path
        if section.dataset in EMBEDDED.values() and path and not EmbeddedAssets(Path(path)).is_build():
            raise ConfigError(
                f"{name}.dataset_path = '{path}' but {name}.dataset = '{section.dataset}', an embedded dataset "
                f"(built in ./{DEFAULT_ASSETS_DIR}), which does not read it: set {name}.dataset to the "
                "dataset stored there (e.g. c4), or unset dataset_path"
            )


register_check(check_dataset_options)


def _reads_the_registry(job_config) -> bool:
    """Whether the job's data loader is torchtitan's text one, which reads torchtitan's dataset registry, and no
    module ``experimental.custom_import`` names may add to it."""
    return (get_train_spec(job_config.model.name).build_dataloader_fn is build_text_dataloader
            and not job_config.experimental.custom_import)


def _is_hub_name(path: str) -> bool:
    """Whether ``path`` is a Hugging Face Hub dataset's name (owner/name), which HF datasets downloads where no folder
    of that path is ("./c4" is a folder's path: no Hub name starts with a dot)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if path.count("/") != 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def check_dataset_folder(job_config) -> None:
    """ConfigError where a dataset a job about to train reads from this machine's files (training's, and validation's
    where it validates) is not there: HF datasets finds no data file there and fails in every rank once they have
    started. A path of the Hub's form (owner/name), which it downloads where no such folder is, is refused only where
    neither the Hub nor a cache can give it (:func:`_check_hub_dataset`); the embedded datasets are built before the
    ranks start. For the launchers' pre-flight on the machines that train."""
    if not _reads_the_registry(job_config):
        return
    for name, section in _sections_read(job_config):
        if section.dataset in EMBEDDED.values() or section.dataset not in DATASETS:
            continue
        path = section.dataset_path or DATASETS[section.dataset].path
        if Path(path).exists():
            continue
        embedded = f"or {'train' if name == 'training' else 'validate'} on the embedded corpus ({name}.dataset = " \
                   f"'{EMBEDDED[name]}')"
        if _is_hub_name(path):
            _check_hub_dataset(path, f"{name}.dataset_path = '{path}' is no folder here (relative to {os.getcwd()}), "
                                     "so HF datasets loads it" if section.dataset_path else
                               f"{name}.dataset = '{section.dataset}' loads '{path}'", f"{name}.dataset_path", embedded)
            continue
        where = "" if Path(path).is_absolute() else f" (relative to {os.getcwd()})"
        field = (f"{name}.dataset_path = '{path}'{where}" if section.dataset_path
                 else f"{name}.dataset = '{section.dataset}' reads '{path}'{where}, which")
        raise ConfigError(f"{field} is not a folder here, and the job loads its data from it: set "
                          f"{name}.dataset_path to the folder that holds the dataset, {embedded}")


HUB_PROBE_TIMEOUT_S = 10.0
"""How long the pre-flight waits for the Hugging Face Hub to answer about a dataset."""


def _check_hub_dataset(name: str, what: str, path_field: str, embedded: str) -> None:
    """ConfigError where a Hub dataset can be neither downloaded nor read from this machine's Hugging Face caches:
    every rank would fail once started ("Couldn't reach 'allenai/c4' on the Hub"). Where any cache holds it, or the
    Hub answers at all (a missing or gated dataset is HF datasets' to name), it is left to HF datasets."""
    import datasets.config
    from huggingface_hub import constants, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    owner, repo = name.split("/")
    cached = (Path(constants.HF_HUB_CACHE) / f"datasets--{owner}--{repo}",
              Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{repo}")
    if any(folder.exists() for folder in cached):
        return
    try:
        HfApi().dataset_info(name, timeout=HUB_PROBE_TIMEOUT_S)
        return
    except HfHubHTTPError:
        return
    except Exception as e:  # no answer: the HTTP client's network error (its class differs by huggingface_hub version)
        why = f"{type(e).__name__}: {e}"
    raise ConfigError(
        f"{what} from the Hugging Face Hub, which this machine cannot reach ({why}), and no Hugging "
        f"Face cache here holds it: download it where the Hub is reachable and set {path_field} to its folder, "
        f"{embedded}")


def _embedded_assets_noise(message: str) -> bool:
    """torchtitan's warning that the embedded assets' tokenizer folder has no safetensors index, which is no fault
    of the job: no job loads HF weights from it."""
    prefix = "model.safetensors.index.json not found at hf_assets_path: "
    if not message.startswith(prefix):
        return False
    # the warning ends its path with the sentence's full stop
    path = message.removeprefix(prefix).split()[0].removesuffix(".")
    folder = Path(path).parent if path.endswith(".json") else Path(path)
    return folder.resolve() == DEFAULT_ASSETS_DIR.resolve()


quiet(_embedded_assets_noise)
