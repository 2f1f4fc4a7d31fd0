"""
Poor man's configurator, after nanoGPT. Usage:

    python train.py config/tiny_fp.py --batch_size=32 --lr=1

Config files are plain Python, exec'd in order over the defaults (they are code, as in
nanoGPT: run only files you trust); then each `--key=value` is parsed with
`ast.literal_eval` (a bare word stays a string). Every override must name an existing
setting and keep its type (an int may stand in for a float), and a setting with a declared
range must lie in it, so that a typo fails at once with a one-line message instead of
silently training the wrong thing.

A group is a dict of settings that one feature reads (a script declares it by giving it a
dict of its keys' ranges, empty for none): each of its keys is a setting of its own,
overridden alone with `--group.key=value`, or several at once with `--group={'key': value}`
or `group = dict(...)` in a config file; the keys not named keep their values.

A setting that was renamed (a flat name that became a group's key) is named in the
script's table of old names, so that an old command line fails with the new spelling.

Ranges are declared by the script beside its settings: 'positive' (above 0),
'non-negative' (0 or above), 'fraction' (0 to 1), 'non-empty', or a tuple of the allowed
values.
Scripts that take positional words (a section, a folder) split them off with `words`
first; every script reads its arguments here and nowhere else. A mistake found while
a script sets up (a file the settings name, settings that cannot go together) ends it
in one line too: `with one_line('data: '):` around that step.
"""
import ast
import contextlib
import copy
import difflib
import inspect
import math
import os
import sys

RANGES = {
    'positive': (lambda v: v > 0, 'above 0'),
    'non-negative': (lambda v: v >= 0, '0 or above'),
    'fraction': (lambda v: 0 <= v <= 1, 'between 0 and 1'),
    'non-empty': (lambda v: len(v) > 0, 'that is not empty'),
}


# what a set-up step raises for a bad setting or file: missing or unreadable (OSError),
# of another shape or value (ValueError, KeyError, TypeError), refused by torch (RuntimeError)
SETUP_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError)


@contextlib.contextmanager
def one_line(step=''):
    """Ends the script with `error: <step><what is wrong>` and exit status 1, no
    traceback, when the set-up step inside raises one of SETUP_ERRORS."""
    try:
        yield
    except SETUP_ERRORS as e:
        sys.exit(f"error: {step}{e}")


def _check(config, key, value, shown=None):
    """value, checked as setting `key` of config (named `shown` in messages)."""
    shown = shown or key
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=1)
        hint = f"; did you mean --{close[0]}?" if close else ""
        raise SystemExit(f"error: unknown config key {key!r}{hint}")
    default = config[key]
    if isinstance(value, float) and not math.isfinite(value):
        raise SystemExit(f"error: {shown}={value!r} is not a finite number; "
                         f"set a finite --{shown}")
    if default is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:
        return float(value)  # --lr=1 means 1.0
    want = type(default).__name__
    got = type(value).__name__
    raise SystemExit(f"error: {shown} must be {want}, got {value!r} ({got})")


def _update_group(config, group, value):
    """The group's settings with value's keys ({key: value}) checked and set."""
    if not isinstance(value, dict):
        raise SystemExit(f"error: {group} is a group of settings, got {value!r}; set one "
                         f"with --{group}.KEY=VALUE or several with --{group}={{'KEY': VALUE}}")
    updated = dict(config[group])
    for key, item in value.items():
        if not isinstance(key, str) or key not in updated:
            close = difflib.get_close_matches(str(key), list(updated), n=1)
            hint = f"; did you mean --{group}.{close[0]}?" if close else ""
            raise SystemExit(f"error: unknown config key '{group}.{key}'{hint}")
        updated[key] = _check(updated, key, item, f'{group}.{key}')
    return updated


def _renamed(key, renamed):
    """A setting's old name is a one-line error that names its new spelling."""
    if key in renamed:
        raise SystemExit(f"error: {key!r} is now {renamed[key]!r}: set --{renamed[key]}=VALUE "
                         f"instead of --{key}")


def _grouped(config, key, groups):
    """A top-level name that is a key of a group is a one-line hint to the group."""
    owner = next((g for g in sorted(groups) if key in config[g]), None)
    if key not in config and owner:
        raise SystemExit(f"error: unknown config key {key!r}; it belongs to a group: "
                         f"set --{owner}.{key}=VALUE (in a config file: {owner}['{key}'])")


def _check_range(key, value, allowed):
    """A setting against its declared range: a name in RANGES or a tuple of values."""
    if isinstance(allowed, tuple):
        if value not in allowed:
            choices = ', '.join(repr(a) for a in allowed)
            raise SystemExit(f"error: {key}={value!r} is not allowed; set --{key} to one "
                             f"of {choices}")
        return
    test, wanted = RANGES[allowed]
    if not test(value):
        raise SystemExit(f"error: {key}={value!r} is out of range; set --{key} to a value "
                         f"{wanted}")


def words(args, allowed=None, most=None):
    """Split a script's positional words from its --key=value arguments. `allowed` (a
    collection) is what a word may be, `most` how many there may be; returns (words, rest)."""
    found = [a for a in args if not a.startswith('--')]
    rest = [a for a in args if a.startswith('--')]
    if most is not None and len(found) > most:
        raise SystemExit(f"error: too many words in {found}; this script takes at most {most}")
    for word in found:
        if allowed is not None and word not in allowed:
            raise SystemExit(f"error: unknown word {word!r}; choose from {', '.join(allowed)}")
    return found, rest


def configure(config, args, ranges=None, renamed=None):
    """Apply config files and --key=value args (a list of strings) to the dict `config`,
    then check every setting named in `ranges` ({key: range, group: {key: range}}).
    `renamed` ({old name: new spelling}) turns a name the script no longer has into
    an error that names the setting that replaced it."""
    renamed = renamed or {}
    groups = {key for key, allowed in (ranges or {}).items() if isinstance(allowed, dict)}
    for arg in args:
        if not arg.startswith('--'):
            if '=' in arg and not arg.endswith('.py'):
                raise SystemExit(f"error: expected --key=value, got {arg!r}; add the --")
            if not os.path.isfile(arg):
                raise SystemExit(f"error: config file {arg!r} not found; "
                                 f"config files live in config/")
            scope = copy.deepcopy(config)  # a group changed in place is still checked
            with open(arg) as f:
                source = f.read()
            try:
                exec(compile(source, arg, 'exec'), scope)
            except SystemExit:  # exit() in a config file would end the run unseen, rc 0
                raise SystemExit(f"error: config file {arg!r} calls exit(); a config file "
                                 f"sets settings, remove that call") from None
            except Exception as e:  # its mistake, in one line: where and what
                frame = e.__traceback__.tb_next  # the config file's own line
                line = getattr(e, 'lineno', None) or (frame.tb_lineno if frame else '?')
                raise SystemExit(f"error: config file {arg!r} line {line}: "
                                 f"{type(e).__name__}: {e}; fix that line") from None
            for key, value in scope.items():
                # imports and helpers a config file may use are not settings
                if key.startswith('_') or inspect.ismodule(value) or callable(value):
                    continue
                if key in groups:
                    config[key] = _update_group(config, key, value)
                elif key not in config or value != config[key]:
                    _renamed(key, renamed)
                    _grouped(config, key, groups)
                    config[key] = _check(config, key, value)
        else:
            key, sep, text = arg[2:].partition('=')
            if not sep:
                raise SystemExit(f"error: expected --key=value, got {arg!r}")
            group, dot, name = key.partition('.')
            if dot and group not in groups:
                _renamed(group, renamed)
                raise SystemExit(f"error: {group!r} is not a group of settings; "
                                 f"expected --key=value, got {arg!r}")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                value = text
            if dot:
                if isinstance(config[group].get(name), str):
                    value = text
                config[group] = _update_group(config, group, {name: value})
            elif key in groups:
                config[key] = _update_group(config, key, value)
            else:
                if isinstance(config.get(key), str):
                    value = text  # --out_dir=123 is the string '123'
                _renamed(key, renamed)
                _grouped(config, key, groups)
                config[key] = _check(config, key, value)
    for key, allowed in (ranges or {}).items():
        if key in groups:
            for name, inner in allowed.items():
                _check_range(f'{key}.{name}', config[key][name], inner)
        else:
            _check_range(key, config[key], allowed)
    return config
