"""Load a config file the way ``--config=path.py:arg`` does, without absl flags.

``load_config("configs/msar.py:size=small")`` returns the locked ``ConfigDict``;
``overrides={"model.d_model": 128}`` sets fields (an unknown field is an error);
``parse_overrides(["model.d_model=128"])`` builds that dict from command-line ``KEY=VALUE``s.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import ml_collections

from msar_jax import config as config_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    path, _, arg = spec.partition(":")
    file = pathlib.Path(path)
    if not file.is_absolute() and not file.exists():
        file = REPO_ROOT / path
    if not file.exists():
        raise FileNotFoundError(f"config file {path!r} not found (looked in . and {REPO_ROOT})")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # config files import configs.common
    module_spec = importlib.util.spec_from_file_location(f"_msar_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg or None)
    config.lock()
    for key, value in (overrides or {}).items():
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
            raise ValueError(f"override {item!r}: must be KEY=VALUE (e.g. train.batch_size=8)")
        python_literals = {"True": True, "False": False, "None": None}
        try:
            out[key] = python_literals[value] if value in python_literals else json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
