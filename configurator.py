"""
Config overrides in nanoGPT style, but checked:

    python train.py configs/shakespeare_char.py --batch_size=32 --compile=False

Defaults live in a dict in the calling script. Each config file (a plain Python file) is executed and its
top-level names override the defaults; then each --key=value does, its value parsed with ast.literal_eval
(falling back to the raw string). Unlike nanoGPT's exec-into-globals, unknown keys and values of the wrong
type stop with a message naming the key, instead of silently creating a new global or crashing later.
"""

import ast
import difflib
import os
import runpy
import types

import errors


class ConfigError(errors.UsageError, ValueError):
    """A bad config file, key or value; the message says which and what would be valid."""


def _type_name(types_):
    return " or ".join("None" if t is type(None) else t.__name__ for t in types_)


def coerce(key, value, allowed, raw=None):
    """Return value converted to one of the allowed types, or raise ConfigError.

    raw is the command-line text, if any: str keys take it verbatim (so --out_dir=123 is the folder '123').
    """
    if value is None and type(None) in allowed:
        return None
    if bool in allowed:  # before the verbatim-string rule, for keys that take both: --compile=True
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
    if str in allowed and raw is not None:
        return value if isinstance(value, str) else raw
    if int in allowed and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():  # --max_iters=5e3
            return int(value)
    if float in allowed and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    raise ConfigError(f"config key '{key}' expects {_type_name(allowed)}, got {value!r} ({type(value).__name__})")


def _unknown(key, valid, where):
    hint = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean '{hint[0]}'?" if hint else ""
    return ConfigError(f"unknown config key '{key}' ({where}).{hint} Valid keys: {', '.join(sorted(valid))}")


def parse_config(defaults, argv, key_types=None):
    """Merge defaults, config files and --key=value overrides from argv into a new dict.

    key_types maps keys to a tuple of allowed types where the default's type is not the whole story
    (e.g. keys whose default is None). Returns None when help was asked for (after printing it).
    """
    key_types = key_types or {}
    allowed = {k: key_types.get(k, (type(v),)) for k, v in defaults.items()}
    config = dict(defaults)
    for arg in argv:
        if arg in ("-h", "--help"):
            width = max(map(len, config))
            print("usage: [config_file.py ...] [--key=value ...]\n\nkeys and their defaults:")
            for k in sorted(config):
                print(f"  {k:<{width}}  {config[k]!r}")
            return None
        if not arg.startswith("--"):  # a config file
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg} (expected a .py file or --key=value)")
            try:
                namespace = runpy.run_path(arg)
            except Exception as e:
                raise ConfigError(f"config file {arg} failed to run: {type(e).__name__}: {e}") from e
            for k, v in namespace.items():
                if k.startswith("_") or isinstance(v, (types.ModuleType, types.FunctionType, type)):
                    continue  # helper imports and functions in the config file are not keys
                if k not in allowed:
                    raise _unknown(k, allowed, f"in {arg}")
                config[k] = coerce(k, v, allowed[k])
            continue
        key, eq, text = arg[2:].partition("=")
        key = key.replace("-", "_")  # --max-iters works too
        if key not in allowed:
            raise _unknown(key, allowed, f"from {arg}")
        if not eq:
            if bool not in allowed[key]:  # a bare --flag only makes sense for booleans
                raise ConfigError(f"config key '{key}' needs a value: --{key}=VALUE")
            text = "True"
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # not a Python literal: a plain string such as --dataset=shakespeare_char
        config[key] = coerce(key, value, allowed[key], raw=text)
    return config
