"""Load a config file the way ``--config=path.py:arg`` does, without absl flags.

``load_config("configs/msar.py:size=small")`` returns the locked ``ConfigDict``;
``overrides={"model.d_model": 128}`` sets fields (an unknown field is an error);
``parse_overrides(["model.d_model=128"])`` builds that dict from command-line ``KEY=VALUE``s.

Every error a user can make here is a ``ConfigError`` with a one-line message naming the field,
the value and the rule; a mistyped key or size names the close ones. The command lines print it
as ``error: ...`` with exit status 1 and no traceback: ``run_absl_cli`` for the absl ones
(``msar_jax.train``, ``msar_jax.accounting``: it loads ``--config`` and checks the override names
itself before ml-collections can wrap an error in its tracebacks), ``run_cli`` for the argparse
ones, and ``positive_int`` / ``non_negative_int`` / ``shard`` for their numeric flags.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import ml_collections

from msar_jax import config as config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config_file(path: str) -> pathlib.Path:
    """``path`` as given, else under the repository root; ``ConfigError`` naming both places."""
    file = pathlib.Path(path)
    if not file.is_absolute() and not file.is_file():
        file = REPO_ROOT / path
    if not file.is_file():
        places = dict.fromkeys([str(pathlib.Path.cwd()), str(REPO_ROOT)])
        error = config_lib.ConfigError(f"config file {path!r}: no such file (looked in {' and '.join(places)})")
        error.field, error.value, error.rule = "config file", path, "no such file"
        raise error
    return file


def _get_config(spec: str) -> ml_collections.ConfigDict:
    """Run the config file's ``get_config(arg)`` for ``spec = "path.py[:arg]"`` (unlocked)."""
    path, _, arg = spec.partition(":")
    file = _config_file(path)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # config files import configs.common
    module_spec = importlib.util.spec_from_file_location(f"_msar_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise config_lib.ConfigError(f"config file {path!r}: defines no get_config(arg) (see configs/common.py)")
    return module.get_config(arg or None)


def check_field(config: ml_collections.ConfigDict, key: str, value=None) -> None:
    """``ConfigError`` unless the dotted ``key`` names a field of ``config``; the message gives
    the close names at the first unknown level (``optim.lrr`` -> "did you mean 'optim.lr'?")."""
    node, done = config, []
    for part in key.split("."):
        name = part.split("[", 1)[0]  # ml-collections paths may index a sequence: a.b[0]
        if not isinstance(node, (ml_collections.ConfigDict, dict)) or name not in node:
            prefix = "".join(f"{d}." for d in done)
            known = list(node.keys()) if isinstance(node, (ml_collections.ConfigDict, dict)) else []
            where = f"{prefix.rstrip('.')} has no field {name!r}" if done else f"no top-level field {name!r}"
            raise config_lib.ConfigError(key, value, f"no such config field ({where})"
                                         + config_lib.close_names(name, known, prefix))
        node = node[name]
        done.append(name)


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    config = _get_config(spec)
    config.lock()
    for key, value in (overrides or {}).items():
        check_field(config, key, value)
        try:
            config.update_from_flattened_dict({key: value})
        except (KeyError, AttributeError) as e:
            raise config_lib.ConfigError(key, value, f"no such config field ({e})") from None
        except TypeError as e:  # ml_collections' type check: a bool field given a string, ...
            raise config_lib.ConfigError(key, value, f"has the wrong type ({e})") from None
    config_lib.validate(config.model)
    return config


def parse_overrides(items) -> dict:
    """``["optim.lr=1e-3", "model.residual.implementation=auto"]`` -> ``{key: value}``; values
    are JSON-parsed where they parse (numbers, booleans, lists), Python's ``True``, ``False``
    and ``None`` too, else kept as strings."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise config_lib.ConfigError(item, None, "must be KEY=VALUE (e.g. train.batch_size=8)", subject="override")
        python_literals = {"True": True, "False": False, "None": None}
        try:
            out[key] = python_literals[value] if value in python_literals else json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------------
# Command lines: every config error is one line on stderr and exit status 1, never a traceback.
# --------------------------------------------------------------------------------------------


def config_error_line(error: BaseException) -> str | None:
    """The one-line message of the ``ConfigError`` in ``error``'s chain (``__cause__`` and
    ``__context__``: ml-collections and absl each wrap an error from ``get_config`` once more),
    the one naming a field if there is one; ``None`` when the chain holds no ``ConfigError``."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, config_lib.ConfigError):
            if error.field is not None:
                return " ".join(str(error).split())
            found = found or error
        error = error.__cause__ or error.__context__
    return " ".join(str(found).split()) if found is not None else None


def exit_with_error(message: str, status: int = 1):
    """Print ``error: message`` as one line on stderr and exit with ``status``."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    raise SystemExit(status)


def run_cli(main, *args, **kwargs):
    """``main(*args, **kwargs)``; a ``ConfigError`` from it becomes one line and exit status 1."""
    try:
        return main(*args, **kwargs)
    except config_lib.ConfigError as e:
        exit_with_error(config_error_line(e))


def _config_flag_args(argv, name: str):
    """Where ``--name``'s value is in ``argv`` (index, the text before the value, the value) and
    the ``--name.KEY`` overrides as (key, value text or None), in absl's forms: ``--name=V``,
    ``--name V``, ``--name.K=V``, ``--name.K V``, ``--name.K`` and ``--noname.K`` (booleans)."""
    where, overrides, i = None, [], 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or not arg.startswith("-"):
            i += 1
            if arg == "--":
                break
            continue
        flag, eq, value = arg.lstrip("-").partition("=")
        if flag == name:
            if eq:
                where = (i, arg[: len(arg) - len(value)], value)
            elif i + 1 < len(argv):
                i += 1
                where = (i, "", argv[i])
        elif flag.startswith((name + ".", "no" + name + ".")):
            key = flag.split(".", 1)[1]
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                i += 1
                eq, value = "=", argv[i]
            overrides.append((key, value if eq else None))
        i += 1
    return where, overrides


def check_config_flags(argv, name: str = "config") -> list[str]:
    """Load ``--config`` and check the names of its ``--config.KEY`` overrides before absl parses
    them, so that every error is a ``ConfigError`` naming the field, the value and the rule (absl
    would print ml-collections' chained tracebacks). Returns ``argv``, the config path made
    absolute where it is found under the repository root but not in the current folder."""
    argv = list(argv)
    where, overrides = _config_flag_args(argv, name)
    if where is None:
        return argv  # absl says the flag is required
    index, head, spec = where
    path, sep, arg = spec.partition(":")
    file = _config_file(path)
    argv[index] = f"{head}{file}{sep}{arg}"
    config = _get_config(argv[index][len(head):])
    for key, value in overrides:
        check_field(config, key, value)
    return argv


def absl_flags_parser(argv):
    """``app.run``'s ``flags_parser``: absl's parse, each error as one line and exit status 1
    (absl's own prints "FATAL Flags parsing error", and a config error inside it is wrapped
    twice with its traceback pasted into the message)."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        exit_with_error(config_error_line(e) or str(e))


def run_absl_cli(main, argv=None, config_flag: str = "config"):
    """``app.run(main)`` for a CLI with a ``DEFINE_config_file`` flag: config errors (the file,
    its ``:key=value`` text, an override's name, a rule ``main`` checks) and flag errors are one
    line on stderr with exit status 1; ``main`` is free to raise ``ConfigError``."""
    from absl import app

    argv = sys.argv if argv is None else argv
    try:
        argv = check_config_flags(argv, config_flag)
    except config_lib.ConfigError as e:
        exit_with_error(config_error_line(e))
    app.run(lambda args: run_cli(main, args), argv=argv, flags_parser=absl_flags_parser)


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts that must be >= 1 (one line from argparse otherwise)."""
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for counts that may be 0."""
    return _bounded_int(text, 0)


def _bounded_int(text: str, low: int) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= {low}")
    return value


def shard(text: str) -> tuple[int, int]:
    """argparse ``type=`` for ``--shard=i/n`` (0 <= i < n)."""
    import argparse

    i, sep, n = text.partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        sep = ""
    if not sep or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r} must be i/n with 0 <= i < n, e.g. 0/4")
    return i, n
