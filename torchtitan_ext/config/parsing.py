"""TOML + command-line parsing into a job config class, with bad keys and values named in one line.

Every torchtitan 0.2.2 key keeps its meaning: the parse itself is torchtitan's
``ConfigManager``. Before it sees the arguments, unknown keys (with the
closest valid one), ill-typed values, a missing or malformed file and
arguments its parser (tyro) would refuse in a box that names no fix (a value
after a switch, a setting without its value, a word that follows no setting)
raise :class:`~torchtitan_ext.config.errors.ConfigError` naming them.
"""

import copy
import difflib
import functools
import importlib
import logging
import math
import os
import types
import typing
from dataclasses import fields, is_dataclass, MISSING
from pathlib import Path
from typing import Any, Literal

from torchtitan.config import ConfigManager
from torchtitan.tools.logging import logger

from torchtitan_ext.config.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

CONFIG_FILE_KEYS = ("--job.config_file", "--job.config-file")
DEFAULT_CONFIG_FILE = "train_configs/debug_model.toml"
"""The job ``run_train.sh`` runs when neither ``CONFIG_FILE`` nor ``--job.config_file`` names one."""


def with_config_file(args: list[str]) -> list[str]:
    """``args`` naming their job config as ``run_train.sh`` does: their ``--job.config_file``, else
    ``$CONFIG_FILE``, else :data:`DEFAULT_CONFIG_FILE`."""
    if _config_file_from_args(args) is not None:
        return args
    return ["--job.config_file", os.environ.get("CONFIG_FILE") or DEFAULT_CONFIG_FILE, *args]


def parse_job_config(args: list[str], config_cls) -> tuple[Any, set[str]]:
    """TOML (``--job.config_file``) + CLI overrides -> (a ``config_cls`` instance, the dotted keys the TOML
    or the command line sets explicitly, which defaults chosen for the machine never override).

    Unknown keys, ill-typed values, a missing or malformed file raise
    ``ConfigError`` with one line, before torchtitan's parser sees them.
    """
    config_file = _config_file_from_args(args)
    text = _read_config_file(config_file) if config_file else b""
    config, explicit = _parsed(config_cls, tuple(args), config_file, text, os.getcwd())
    return copy.deepcopy(config), set(explicit)


@functools.lru_cache(maxsize=64)
def _parsed(config_cls, arguments: tuple[str, ...], config_file: str | None, text: bytes,
            working_folder: str) -> tuple[Any, frozenset[str]]:
    """One parse per class, arguments, file content and working folder (torchtitan's checks read paths relative
    to it): torchtitan's parser (tyro) builds its parser from the config classes at every call, a tenth of a
    second, and the planner and the tools read one job many times. The caller gets a copy: the cached config is
    never handed out."""
    args = list(arguments)
    toml_values = _toml_values(config_file, text) if config_file else {}
    custom_module = _custom_config_module(args, toml_values)
    if custom_module:
        try:
            custom = importlib.import_module(custom_module)
        except ImportError as e:
            raise ConfigError(f"job.custom_config_module = '{custom_module}' cannot be imported ({e}): "
                              "give an importable module that defines JobConfig") from None
        if not hasattr(custom, "JobConfig"):
            raise ConfigError(f"job.custom_config_module = '{custom_module}' defines no JobConfig: add one")
        config_cls = _merged_with(config_cls, custom.JobConfig)
    _check_toml(config_cls, toml_values, config_file)
    _check_cli(config_cls, args)
    logger.addFilter(_PARSE_WARNINGS)  # for the parse only: a process's other logging is not the parse's
    try:
        config = _without_empty_lists(_config_manager(config_cls).parse_args(args))
    finally:
        logger.removeFilter(_PARSE_WARNINGS)
    return config, frozenset(_explicit_settings(toml_values, args))


class _EachParseWarningOnce(logging.Filter):
    """torchtitan's parse warns about the job, not the arguments: the layout advisor parses one job with each
    layout's overrides, and would print a warning once per layout. Only the records of torchtitan's config manager
    are held to once; every other record passes.

    Its warning that ``model.hf_assets_path`` does not exist is left out: the folder matters only where a rank
    reads it, which the launchers' pre-flight checks with the fix (the tokenizer; an HF checkpoint to start
    from), while a plan or a dry run checks a job for machines that hold it."""

    MANAGER_FILE = os.path.join("torchtitan", "config", "manager.py")

    def __init__(self):
        super().__init__()
        self.shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.pathname.endswith(self.MANAGER_FILE):
            return True
        message = record.getMessage()
        if message in self.shown or (message.startswith("HF assets path ") and message.endswith(" does not exist!")):
            return False
        self.shown.add(message)
        return True


_PARSE_WARNINGS = _EachParseWarningOnce()


def _without_empty_lists(config):
    """``config`` with every list of strings that an empty value set ([""], from torchtitan's comma-separated rule:
    ``--model.converters ''``) made the empty list it means."""
    for item in fields(config):
        value = getattr(config, item.name)
        if is_dataclass(value):
            _without_empty_lists(value)
        elif value == [""]:
            setattr(config, item.name, [])
    return config


@functools.cache
def _config_manager(config_cls) -> ConfigManager:
    """One ConfigManager per config class: each one built registers torchtitan's list-of-strings rule with tyro once
    more, in the one registry every later parse runs every copy of (a process that parsed N configs paid N copies
    per field)."""
    return ConfigManager(config_cls=config_cls)


@functools.cache
def _merged_with(config_cls, custom_cls) -> type:
    """``config_cls`` merged with a custom config module's JobConfig, once per pair (a parse's class is its
    manager's key)."""
    return ConfigManager._merge_configs(config_cls, custom_cls)


def _config_file_from_args(args: list[str]) -> str | None:
    found = None
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in CONFIG_FILE_KEYS:
            if not value:
                if i + 1 >= len(args):
                    raise ConfigError(f"{key} needs a path: {key}=train_configs/debug_model.toml")
                value = args[i + 1]
            if found is not None and value != found:
                raise ConfigError(
                    f"--job.config_file is given twice ('{found}' and '{value}'): pass one "
                    "(with run_train.sh: CONFIG_FILE=... or --job.config_file, not both)"
                )
            found = value
    return found


def _read_config_file(path: str) -> bytes:
    if not Path(path).is_file():
        where = "" if Path(path).is_absolute() else f" (relative to {os.getcwd()}, where the command runs)"
        raise ConfigError(
            f"config file '{path}'{where} not found: set CONFIG_FILE (or --job.config_file) "
            f"to an existing TOML, e.g. {_shipped_example()}"
        )
    return Path(path).read_bytes()


def _shipped_example() -> str:
    """The repository's default job config, as a path from the folder the command runs in where it is below it
    (a checkout's; a package installed without the repository has no train_configs)."""
    shipped = Path(__file__).resolve().parents[2] / DEFAULT_CONFIG_FILE
    if not shipped.is_file():
        return DEFAULT_CONFIG_FILE
    relative = os.path.relpath(shipped)
    return str(shipped) if relative.startswith("..") else relative


def _toml_values(path: str, text: bytes) -> dict[str, Any]:
    try:
        return tomllib.loads(text.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' is not valid UTF-8 TOML: {e}") from None


def _custom_config_module(args: list[str], toml_values: dict[str, Any]) -> str:
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in ("--job.custom_config_module", "--job.custom-config-module"):
            return value or (args[i + 1] if i + 1 < len(args) else "")
    job = toml_values.get("job", {})
    return job.get("custom_config_module", "") if isinstance(job, dict) else ""


def _field_types(cls) -> dict[str, Any]:
    return {f.name: f.type for f in fields(cls)}


def _switches(cls) -> set[str]:
    """The fields of ``cls`` the command line sets as switches (``--x.key``, ``--x.no_key``): bools with a default.
    tyro asks a word of a bool without one, and of an optional bool (True, False or None)."""
    return {f.name for f in fields(cls)
            if f.type is bool and (f.default is not MISSING or f.default_factory is not MISSING)}


def _unknown_key_error(section: str, key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key '{section}{key}' in {where}: {hint}")


def _check_toml(cls, values: dict[str, Any], path: str | None, prefix: str = "") -> None:
    types_ = _field_types(cls)
    for key, value in values.items():
        if key not in types_:
            raise _unknown_key_error(prefix, key, list(types_), path or "the config")
        if is_dataclass(types_[key]) and isinstance(value, dict):
            _check_toml(types_[key], value, path, f"{prefix}{key}.")
            continue
        problem = _type_problem(types_[key], value)
        if problem:
            raise ConfigError(f"{prefix}{key} = {value!r} in {path or 'the config'}: {problem}")


def command_line_keys(args: list[str]) -> frozenset[str]:
    """The dotted keys the command line (not the TOML file) sets; "--x.no-flag" gives "x.flag"."""
    return frozenset(key if not key.split(".")[-1].startswith("no_") else key.replace(".no_", ".", 1)
                     for key in _cli_keys(args))


def _cli_keys(args: list[str]) -> list[str]:
    """Dotted keys the command line sets ("training.steps"; "--x.no-flag" gives "x.no_flag")."""
    return [
        arg[2:].partition("=")[0].replace("-", "_")
        for arg in args
        if arg.startswith("--") and arg not in ("--help", "-h")
    ]


def _explicit_settings(toml_values: dict[str, Any], args: list[str]) -> set[str]:
    def flatten(values: dict[str, Any], prefix: str = ""):
        for key, value in values.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return set(flatten(toml_values)) | command_line_keys(args)


def _check_cli(cls, args: list[str]) -> None:
    """Each argument is ``--section.key value`` (``--section.key=value``), a switch (``--section.key``,
    ``--section.no_key``) or one of a list of lists' values: anything else would stop torchtitan's parser (tyro) in a
    box that names neither the setting nor the fix."""
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        if arg in ("--help", "-h"):
            continue
        if not arg.startswith("--"):
            raise _stray_argument_error(arg)  # a value's word is consumed with its setting below
        dotted, has_value, value = arg[2:].partition("=")
        *sections, key = dotted.replace("-", "_").split(".")
        target, prefix = cls, ""
        for section in sections:
            types_ = _field_types(target)
            if section not in types_ or not is_dataclass(types_[section]):
                raise _unknown_key_error(prefix, section, list(types_), "the command line")
            target, prefix = types_[section], f"{prefix}{section}."
        types_ = _field_types(target)
        switches = _switches(target)
        switch = key[3:] if key.startswith("no_") and key not in types_ and key[3:] in switches else key
        if switch not in types_:
            if key.startswith("no_") and key[3:] in types_ and _members(types_[key[3:]]) == [bool]:
                raise ConfigError(f"--{prefix}{key}: {prefix}{key[3:]} takes a word, not a switch: write "
                                  f"--{prefix}{key[3:]} False")
            raise _unknown_key_error(prefix, key, list(types_), "the command line")
        field_type = types_[switch]
        given = [value] if has_value else []
        while index < len(args) and _is_value(args[index]) and (not given or _takes_words(field_type)):
            given.append(args[index])
            index += 1
        if switch in switches:
            if given:
                raise ConfigError(f"--{prefix}{key} {' '.join(given)}: --{prefix}{switch} is a switch and takes no "
                                  f"value: --{prefix}{switch} turns it on, --{prefix}no_{switch} off")
            continue
        if not given and not _takes_words(field_type):
            dashed = index < len(args) and not args[index].startswith("--")
            raise ConfigError(f"--{prefix}{key} has no value: give one, as in --{prefix}{key} <value>" + (
                f" (a value that starts with '-' follows '=': --{prefix}{key}={args[index]})" if dashed else ""))
        for text in given:
            problem = _type_problem(field_type, text, from_text=True)
            if problem:
                raise ConfigError(f"--{prefix}{key} {text}: {problem}")


def _is_value(word: str) -> bool:
    """Whether torchtitan's parser (tyro 1) reads ``word`` after a setting as its value: anything but ``--`` and a
    word of dashes then a letter (an option to it), a negative number (-5, -.5, -1e9, -inf) being a value."""
    key = word.partition("=")[0]
    if word == "--":
        return False
    if key.startswith("-") and key[1:2] not in ("", "-") and (
            key[1].isdigit() or key[1] == "." or key[1:].lower() in ("inf", "nan", "infinity")):
        return True
    return not (key.startswith("-") and len(key) > 1 and key.lstrip("-")[:1].isalpha())


def _takes_words(field_type) -> bool:
    """Whether a setting's command-line value is any number of words, none included: a container (a list of lists
    such as ``--parallelism.module_fqns_per_model_part a,b c``, a tuple, a set, a dict, a list of numbers), as tyro
    reads it, but a list of strings, which torchtitan's rule reads as one comma-separated word. Every other setting
    takes one word, a switch none."""
    return any(typing.get_origin(m) in (list, tuple, set, frozenset, dict) and m != list[str]
               for m in _members(field_type))


def _members(field_type) -> list:
    """A union's types but None; any other type alone."""
    if typing.get_origin(field_type) in (typing.Union, types.UnionType):
        return [m for m in typing.get_args(field_type) if m is not type(None)]
    return [field_type]


def _stray_argument_error(arg: str) -> ConfigError:
    """A word that follows no setting: a second value, or a setting written without its ``--``."""
    if "=" in arg and "." in arg.partition("=")[0]:
        return ConfigError(f"'{arg}' is not a setting: write --{arg}")
    return ConfigError(f"'{arg}' follows no setting that takes it: write each setting as --section.key value "
                       "(--training.steps 10), a switch as --section.key or --section.no_key")


def _type_problem(field_type, value, from_text: bool = False) -> str | None:
    """Why ``value`` cannot be a ``field_type`` (None if it can, or if the type is not checked here).

    ``from_text``: the value is command-line text, to be read as that type.
    """
    origin = typing.get_origin(field_type)
    if origin is Literal:
        choices = typing.get_args(field_type)
        if value in choices or (from_text and value in [str(c) for c in choices]):
            return None
        return f"use one of {', '.join(repr(c) for c in choices)}"
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(field_type)
        if type(None) in members and (value is None or (from_text and value == "None")):
            return None
        problems = [_type_problem(member, value, from_text) for member in members if member is not type(None)]
        return None if any(p is None for p in problems) else problems[0]
    if field_type is bool:  # a plain bool is a switch on the command line; an optional one takes a word
        if isinstance(value, bool) or (from_text and value in ("True", "False")):
            return None
        return "use True or False" if from_text else "use true or false"
    if field_type in (int, float):
        if from_text:
            try:
                number = int(value) if field_type is int else float(value)
            except ValueError:
                return f"use {'an integer' if field_type is int else 'a number'}"
            return None if field_type is int or math.isfinite(number) else "use a finite number"
        if isinstance(value, bool) or not isinstance(value, (int, float) if field_type is float else int):
            return f"use {'an integer' if field_type is int else 'a number'}"
        return None
    if field_type is str and not from_text and not isinstance(value, str):
        return "use a string"
    return None


