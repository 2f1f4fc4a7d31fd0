"""
Poor man's configurator, after nanoGPT. Usage:

    python train.py config/tiny_fp.py --batch_size=32 --lr=1

Config files are plain Python, exec'd in order over the defaults; then each
`--key=value` is parsed with `ast.literal_eval` (a bare word stays a string). Every
override must name an existing setting and keep its type (an int may stand in for a
float), so that a typo fails at once with a one-line message instead of silently
training the wrong thing.
"""
import ast
import difflib
import inspect
import os


def _check(config, key, value):
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=1)
        hint = f"; did you mean --{close[0]}?" if close else ""
        raise SystemExit(f"error: unknown config key {key!r}{hint}")
    default = config[key]
    if default is None or value is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:
        return float(value)  # --lr=1 means 1.0
    want = type(default).__name__
    got = type(value).__name__
    raise SystemExit(f"error: {key} must be {want}, got {value!r} ({got})")


def configure(config, args):
    """Apply config files and --key=value args (a list of strings) to the dict `config`."""
    for arg in args:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise SystemExit(f"error: config file {arg!r} not found; "
                                 f"config files live in config/")
            scope = dict(config)
            with open(arg) as f:
                exec(f.read(), scope)
            for key, value in scope.items():
                # imports and helpers a config file may use are not settings
                if key.startswith('_') or inspect.ismodule(value) or callable(value):
                    continue
                if key not in config or value is not config[key]:
                    config[key] = _check(config, key, value)
        else:
            key, sep, text = arg[2:].partition('=')
            if not sep:
                raise SystemExit(f"error: expected --key=value, got {arg!r}")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text
            if isinstance(config.get(key), str):
                value = text  # --out_dir=123 is the string '123'
            config[key] = _check(config, key, value)
    return config
