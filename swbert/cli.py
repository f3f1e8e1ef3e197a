"""The one command-line convention of swbert's entry points: a typed config dataclass, a recipe
file, and `--key value` overrides.

    launchers/pretrain.py --config base_shared --lr 2e-4 --allow-resume-change seed,data
    launchers/finetune_glue.py --checkpoint std=a shared=b --tasks rte mrpc --learning-rates 1e-4 2e-5

- A recipe (`--config FILE`, YAML or TOML, or the name of a shipped one) sets fields; the command
  line overrides it. Dashes and underscores are the same (`--lr-schedule`, `--lr_schedule`).
- Values take the field's type: numbers, `true/false` (a bare `--flag` is true, `--no-flag`
  false), `none` for an
  optional field, and lists as several values (`--seeds 1 2 3`), a comma-separated value or a
  JSON list. `Literal` fields accept their choices only.
- An unknown key is an error with the closest field's name, never silently ignored; so is a
  missing required field.
- `--help` lists every field with its type, default and the comment written next to it in the
  dataclass (on its line, the lines above it, or a string right below it).

Why not `transformers.HfArgumentParser` or argparse: neither suggests the field a typo meant,
merges a recipe file under the command line with the same typing, nor reads a field's help from the
comment beside it; all three are what users of the training recipes rely on.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

T = TypeVar("T")
# added by the deepspeed launcher to every worker's command line
LAUNCHER_ARGS = ("--local_rank", "--local-rank")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _aliases(cls: type) -> dict[str, str]:
    """Every accepted spelling of a key (field names and `metadata={"aliases": ...}`) -> field name."""
    names = {}
    for f in dataclasses.fields(cls):
        for key in (f.name, *f.metadata.get("aliases", ())):
            names[key.replace("-", "_")] = f.name
    return names


def unknown_key(cls: type, key: str, where: str) -> ValueError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
    return ValueError(f"unknown config key {key!r} in {where}{hint}")


def literal_choices(tp: Any) -> tuple[Any, ...]:
    """The choices of a `Literal[...]` type (also inside `X | None` and `list[...]`), else ()."""
    if get_origin(tp) is Literal:
        return get_args(tp)
    if get_origin(tp) in (list, Union, types.UnionType):
        for arg in get_args(tp):
            if choices := literal_choices(arg):
                return choices
    return ()


def _base(tp: Any) -> Any:
    """The type a value is parsed into: `int | None` -> int, `Literal[...]` -> str."""
    if get_origin(tp) in (Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    return tp


def is_switch(tp: Any) -> bool:
    """Whether a field is an on/off switch with more settings (e.g. `compile`: auto, on, off)."""
    return {"on", "off"} <= set(literal_choices(tp))


def parse_value(name: str, raw: Any, tp: Any, split: bool = True) -> Any:
    """A command-line string (or a recipe value) as the field's type; lists take a list of strings,
    and (unless `split` is false: a field of file names, `metadata={"commas": False}`) a
    comma-separated or JSON list too."""
    optional = get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)
    if isinstance(raw, str) and optional and raw.lower() in ("none", "null"):
        return None
    if is_switch(tp) and str(raw).lower() in _BOOL_WORDS:
        # a switch with more than two settings: YAML reads an unquoted on/off as a boolean, and the
        # spellings of a boolean (what such a switch was before it had `auto`) mean the same
        return "on" if str(raw).lower() in ("true", "1", "yes") else "off"
    base = _base(tp)
    if get_origin(base) is list:
        item = get_args(base)[0]
        if not split:
            return [parse_value(name, x, item) for x in (raw if isinstance(raw, list) else [raw])]
        if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0].startswith("["):
            raw = " ".join(raw)  # a JSON list the shell split at its spaces
        if isinstance(raw, str) and raw.startswith("["):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                raise ValueError(f"{_flag(name)} {raw!r}: not a JSON list") from None
        items = raw if isinstance(raw, list) else [raw]
        # several values, comma-separated ones, or both: --seeds 1 2 3, --seeds 1,2,3
        items = [
            x.strip() if isinstance(x, str) else x
            for s in items
            for x in (s.split(",") if isinstance(s, str) else [s])
        ]
        return [parse_value(name, x, item) for x in items if x != ""]
    if raw is None and not optional:
        raise ValueError(f"{name} has no value: give it one, or leave the key out for its default")
    if not isinstance(raw, str):
        return _typed(name, raw, base)
    try:
        if base is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
        if base is int:
            return int(float(raw)) if "e" in raw.lower() else int(raw)
        if base is float:
            return float(raw)
        if base is Path:
            return Path(raw)
    except ValueError:
        raise ValueError(f"{_flag(name)} {raw!r}: expected {getattr(base, '__name__', base)}") from None
    return raw


_TYPE_NAMES = {
    bool: "boolean",
    int: "whole number",
    float: "number",
    str: "string",
    Path: "path",
    list: "list",
    dict: "mapping",
}


def _typed(name: str, raw: Any, base: Any) -> Any:
    """A recipe's (already typed) value checked against the field's type: `lr: [1, 2]` or
    `train_steps: 1.5` fails here, naming the key, instead of deep inside the run."""
    if raw is None or base is Any or not isinstance(base, type):
        return raw
    if base is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    if base is Path and isinstance(raw, str):
        return Path(raw)
    if isinstance(raw, base) and not (isinstance(raw, bool) and base is not bool):
        return raw
    got = _TYPE_NAMES.get(type(raw), type(raw).__name__)
    raise ValueError(f"{name}={raw!r} is a {got}, expected a {_TYPE_NAMES.get(base, base.__name__)}")


def _resolve_recipe(path: str | Path, recipes_dir: Path | None) -> Path:
    p = Path(path)
    if not p.exists() and recipes_dir is not None and (recipes_dir / f"{path}.yaml").exists():
        p = recipes_dir / f"{path}.yaml"
    if not p.is_file():
        shipped = ", ".join(sorted(x.stem for x in recipes_dir.glob("*.yaml"))) if recipes_dir else "none"
        raise FileNotFoundError(f"recipe {path} not found (shipped recipes: {shipped})")
    return p


def _parse_recipe(p: Path) -> tuple[Any, dict[str, int]]:
    """A recipe file's data and the line of each top-level key (YAML; none for TOML). Syntax errors
    and files that are not text are one ValueError naming the file (and the line when known)."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"recipe {p} is not a text file (not UTF-8): pass a YAML or TOML recipe") from None
    if "\x00" in text:
        raise ValueError(f"recipe {p} is not a text file (it holds NUL bytes): pass a YAML or TOML recipe")
    if p.suffix == ".toml":
        try:
            return tomllib.loads(text), {}
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"recipe {p}: not valid TOML ({err})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"recipe {p}{where}: not valid YAML ({problem})") from None
    lines = {}
    if isinstance(node, yaml.MappingNode):
        lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return data, lines


def read_recipe(
    path: str | Path, recipes_dir: Path | None = None, lines: dict[str, int] | None = None
) -> dict[str, Any]:
    """A recipe file (YAML or TOML), or the name of one shipped in `recipes_dir`; `lines`, when
    given, is filled with the line of each key (YAML), for errors that name it."""
    p = _resolve_recipe(path, recipes_dir)
    data, found = _parse_recipe(p)
    if not isinstance(data, dict):
        raise ValueError(f"recipe {p} must hold a mapping of config keys, got {type(data).__name__}")
    if lines is not None:
        lines.update(found)
    return data


def recipe_location(recipe: str | Path, recipes_dir: Path | None, lines: dict[str, int], key: str) -> str:
    """`recipe FILE, line N, key K` (the line when known), the prefix of an error about a value."""
    p = _resolve_recipe(recipe, recipes_dir)
    line = f", line {lines[key]}" if key in lines else ""
    return f"recipe {p}{line}, key {key!r}"


def positional_fields(cls: type) -> list[str]:
    """The fields given by position (`metadata={"positional": True}`), in order: a tool's inputs and
    outputs (`convert from-hf IN OUT`); each may be given as `--key value` too."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("positional")]


def _display(cls: type, name: str) -> str:
    return name.upper() if name in positional_fields(cls) else _flag(name)


_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def _is_flag(tp: Any) -> bool:
    """A field a bare `--flag` sets on and `--no-flag` off: a boolean, or an on/off switch."""
    return _base(tp) is bool or is_switch(tp)


def split_overrides(cls: type, argv: Sequence[str]) -> dict[str, Any]:
    """`--key value` pairs (a list field takes every value up to the next `--key`) and positional
    values -> {field: raw}. With positional fields, any other field takes one value (a boolean one
    only `true`/`false`, so that `--overwrite OUT` reads OUT as a position)."""
    hints, names = get_type_hints(cls), _aliases(cls)
    positional = positional_fields(cls)
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            free = [p for p in positional if p not in out]
            if not free:
                expected = "overrides are --key value pairs"
                if positional:
                    expected = "the positions are " + " ".join(p.upper() for p in positional)
                raise ValueError(f"unexpected argument {token!r}: {expected}")
            name = free[0]
            if get_origin(_base(hints[name])) is list:
                j = i
                while j < len(argv) and not argv[j].startswith("--"):
                    j += 1
                out[name], i = list(argv[i:j]), j
            else:
                out[name], i = token, i + 1
            continue
        key, eq, inline = token[2:].partition("=")
        name = names.get(key.replace("-", "_"))
        negated = names.get(key.replace("-", "_").removeprefix("no_")) if key.startswith("no") else None
        if name is None and negated is not None and _is_flag(hints[negated]) and not eq:
            out[negated] = "false"  # --no-measure: a boolean field (or an on/off switch) set to false
            i += 1
            continue
        if name is None:
            raise unknown_key(cls, key, "the command line")
        values: list[str] = [inline] if eq else []
        i += 1
        is_list = get_origin(_base(hints[name])) is list
        while not eq and i < len(argv) and not argv[i].startswith("--"):
            if positional and not is_list and (values or _base(hints[name]) is bool):
                if values or argv[i].lower() not in _BOOL_WORDS:
                    break  # the rest are positions
            values.append(argv[i])
            i += 1
        if not values:
            if not _is_flag(hints[name]):
                raise ValueError(f"{_flag(key)} needs a value")
            values = ["true"]
        elif len(values) > 1 and not is_list:
            raise ValueError(f"{_flag(key)} takes one value, got {' '.join(values)}")
        out[name] = values if is_list and not eq else values[0]
    return out


def build_config(
    cls: type[T],
    recipe: str | Path | None,
    overrides: Sequence[str],
    recipes_dir: Path | None = None,
) -> T:
    """Recipe values, then `--key value` overrides, typed and checked (the instance's `check()`)."""
    hints, names = get_type_hints(cls), _aliases(cls)
    raw: dict[str, Any] = {}
    from_recipe: dict[str, str] = {}  # field -> the recipe key that set it (not overridden)
    lines: dict[str, int] = {}
    if recipe is not None:
        for key, value in read_recipe(recipe, recipes_dir, lines).items():
            name = names.get(key.replace("-", "_"))
            if name is None:
                raise unknown_key(cls, key, f"recipe {recipe}")
            raw[name], from_recipe[name] = value, key
    for name, value in split_overrides(cls, overrides).items():
        raw[name] = value
        from_recipe.pop(name, None)

    def located(name: str | None, err: ValueError) -> ValueError:
        """`err`, prefixed with the recipe's file, line and key when `name` came from it."""
        if name not in from_recipe:
            return err
        return ValueError(f"{recipe_location(recipe, recipes_dir, lines, from_recipe[name])}: {err}")

    commas = {f.name: f.metadata.get("commas", True) for f in dataclasses.fields(cls)}
    values = {}
    for name, value in raw.items():
        try:
            values[name] = parse_value(name, value, hints[name], commas[name])
        except ValueError as err:
            raise located(name, err) from None
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in values:
            raise ValueError(f"{_display(cls, f.name)} is required")
    config = cls(**values)
    try:
        check_choices(config)
        if hasattr(config, "check"):
            config.check()
    except ValueError as err:  # a check names the field first: `name=value ...` or `name: ...`
        named = re.match(r"^(\w+)[=:]", str(err))
        raise located(named.group(1) if named else None, err) from None
    return config


def check_choices(config: Any) -> None:
    """Raise a ValueError naming the field when a `Literal` field holds a value outside its choices."""
    hints = get_type_hints(type(config))
    for f in dataclasses.fields(config):
        choices = literal_choices(hints[f.name])
        value = getattr(config, f.name)
        for item in value if isinstance(value, list) else [value]:
            if choices and item is not None and item not in choices:
                raise ValueError(f"{f.name}={item!r} is not one of {', '.join(map(str, choices))}")


def parse_cli(
    cls: type[T],
    argv: Sequence[str],
    usage: str,
    default_recipe: str | None = None,
    recipes_dir: Path | None = None,
    recipes: bool = True,
) -> T:
    """`[--config RECIPE] [--key value ...]` -> a checked `cls`; `--help` prints the help and exits.
    `recipes=False`: a tool without recipe files, whose own field may be called `config`."""
    recipe, rest = default_recipe, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(help_text(cls, usage, default_recipe, recipes_dir, recipes))
            sys.exit(0)
        if not recipes:
            rest.append(arg)
            i += 1
            continue
        if arg.startswith(LAUNCHER_ARGS):
            i += 1 if "=" in arg else 2
            continue
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a recipe file or name")
            recipe, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            recipe, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    return build_config(cls, recipe, rest, recipes_dir)


def parse_or_exit(cls: type[T], argv: Sequence[str] | None, usage: str, **kwargs: Any) -> T:
    """`parse_cli` for an entry point: bad input prints `error: ...` and exits with status 2."""
    try:
        return parse_cli(cls, sys.argv[1:] if argv is None else argv, usage, **kwargs)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def exit_on_bad_input(work: Callable[[], T]) -> T:
    """`work()`, an entry point's whole job; bad input it finds late (a data file, a checkpoint:
    ValueError and FileNotFoundError, their subclasses included) prints `error: <message>` on one
    line and exits with status 2, as a bad flag does. The message names the file or flag and what
    to do; a chained traceback would only bury it."""
    try:
        return work()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(2) from None


_FIELD_LINE = re.compile(r"^\s{4}(\w+):\s*[^=#]+?(?:=\s*.*?)?(?:#\s*(.*))?$")
_COMMENT_LINE = re.compile(r"^\s{4}#\s?(.*)$")


def field_descriptions(cls: type) -> dict[str, str]:
    """Each field's description, read from the class source: the comment on its line, else the
    comment lines right above it, else a string literal right below it. A subclass that redefines a
    field (to change its default) may describe it anew; otherwise its base class's words hold."""
    found: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        found.update(_own_descriptions(klass))
    return found


def _own_descriptions(cls: type) -> dict[str, str]:
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source shipped (a frozen or .pyc-only install)
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, str] = {}
    above: list[str] = []
    last: str | None = None  # the field defined on the line before
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if comment := _COMMENT_LINE.match(line):
            above.append(comment.group(1).strip())
            continue
        if line.startswith('    """') and last is not None and last not in found:
            text = line.strip()[3:]
            while '"""' not in text and i < len(lines):
                text += " " + lines[i].strip()
                i += 1
            found[last] = text.replace('"""', "").strip()
            last, above = None, []
            continue
        match = _FIELD_LINE.match(line)
        last = match.group(1) if match and match.group(1) in names else None
        if last and (match.group(2) or above):
            found[last] = match.group(2) or " ".join(above)
        above = []
    return found


def _type_name(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("Literal[", "one of [")


def help_text(
    cls: type,
    usage: str,
    default_recipe: str | None = None,
    recipes_dir: Path | None = None,
    recipes: bool = True,
) -> str:
    """Usage, the recipes, then every field: `--key  type, default` and its description."""
    lines = [usage, ""]
    if recipes and recipes_dir is not None:
        shipped = ", ".join(sorted(p.stem for p in recipes_dir.glob("*.yaml")))
        lines += [
            f"--config RECIPE   a YAML/TOML recipe, or a shipped one: {shipped} (default: {default_recipe})",
            "",
        ]
    elif recipes:
        lines += ["--config FILE     a YAML/TOML file of keys (the command line overrides it)", ""]
    lines.append("Every key can be given as --key value (dashes or underscores):")
    described = field_descriptions(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = (
                f"default: {str(f.default)!r}" if isinstance(f.default, Path) else f"default: {f.default!r}"
            )
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default: {f.default_factory()!r}"
        else:
            default = "required"
        aliases = "".join(f" (or {_flag(a)})" for a in f.metadata.get("aliases", ()))
        if f.metadata.get("positional"):
            aliases += f" (by position, or {_flag(f.name)})"
        lines.append(f"  {_display(cls, f.name):<26} {_type_name(f.type)}, {default}{aliases}")
        if f.name in described:
            lines.append(f"  {'':<26} {described[f.name]}")
    return "\n".join(lines)
