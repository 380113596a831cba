"""A job's checkpoint folder as torchtitan 0.2.2 writes it: a ``step-N`` folder per save, complete once DCP has
written its ``.metadata`` (the coordinator writes it last).

The trainer reads it to choose what to load, keep and set aside; the launchers' pre-flight to check what a job
starts from; the supervisor to say what a rerun resumes from. No torch import: the supervisor stays light.
"""

import re
from pathlib import Path

CHECKPOINT_NAME = re.compile(r"step-(\d+)")


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def checkpoint_steps(folder: Path) -> tuple[list[int], list[int]]:
    """(complete steps, torn steps) of the ``step-N`` folders in ``folder``, each sorted."""
    complete, torn = [], []
    if folder.is_dir():
        for entry in folder.iterdir():
            match = CHECKPOINT_NAME.fullmatch(entry.name)
            if match and entry.is_dir():
                (complete if is_complete(entry) else torn).append(int(match.group(1)))
    return sorted(complete), sorted(torn)
