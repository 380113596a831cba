"""What a process prints: short lines, and torchtitan's messages that say nothing about the user's job
left out or said once.

:func:`init_logger` takes the place of torchtitan's: the same root logger
(torchtitan logs through it), a line that starts with the time (and the level
when it is not INFO), so that a step line fits in 120 columns with torchrun's
``[rankN]:`` prefix, and a filter: repeated lines said once, and the messages
features register with :func:`quiet`, each with its reason.
"""

import logging
from collections.abc import Callable
from typing import TextIO

from torchtitan.tools import logging as tt_logging

_quiet_rules: list[Callable[[str], bool]] = []


class _Console(logging.Formatter):
    def __init__(self):
        super().__init__(datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname} "
        return f"{self.formatTime(record, self.datefmt)} {level}{record.getMessage()}"


class _KnownNoise(logging.Filter):
    """Drops torchtitan's messages that are not about the user's job."""

    def __init__(self):
        super().__init__()
        self.seen_moe_line = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(rule(message) for rule in _quiet_rules):
            return False
        # one line per MoE layer at model construction (58 for DeepSeek-V3 671B), all alike: said once
        if message.startswith("Standard MoE: "):
            seen, self.seen_moe_line = self.seen_moe_line, True
            return not seen
        return True


def quiet(rule: Callable[[str], bool]) -> None:
    """Leave out every log message for which ``rule(message)`` is true (a feature's own known noise,
    registered with the reason beside it). Idempotent."""
    if rule not in _quiet_rules:
        _quiet_rules.append(rule)


def init_logger(level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """torchtitan's console logging with this harness's line format and noise filter, from ``level`` up, to
    ``stream`` (default stdout, as torchtitan's; the launchers' checks: warnings only, on stderr, since the
    launchers read their stdout)."""
    tt_logging.init_logger()
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(_Console())
        handler.setLevel(level)
        if stream is not None:
            handler.setStream(stream)
    if not any(isinstance(f, _KnownNoise) for f in root.filters):
        root.addFilter(_KnownNoise())
