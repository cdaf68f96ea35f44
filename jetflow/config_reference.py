"""The configuration reference: every key of a run config with its type, default, valid values and description,
read from the config dataclasses of jetflow/config.py (the description is the field's attribute docstring, the
string literal right after it, read from the source with `ast`). `jetflow config explain KEY` prints one entry;
scripts/gen_docs.py writes the docs site's page (reference/config.md) from the same entries.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import textwrap
import typing
from pathlib import Path

from jetflow.config import Config, ConfigError

CONFIG_SOURCE = Path(__file__).with_name("config.py")


class Key(typing.NamedTuple):
    """One config key as the reference lists it."""
    key: str  # dotted, e.g. rollout.max_staleness
    type: str  # the annotation as written in config.py
    default: str  # the default, as YAML would write it
    choices: tuple  # the values a Literal type allows (empty: any value of the type)
    doc: str  # the attribute docstring ("" when it has none)


def attribute_docs(source: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{class name: {field: (annotation source, docstring)}} of every class in `source`: a field's docstring is the
    string literal standing right after it (PEP 257's attribute docstring), "" when there is none."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, tuple[str, str]] = {}
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = ""
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    doc = " ".join(nxt.value.value.split())
                fields[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
        out[node.name] = fields
    return out


def yaml_value(value) -> str:
    """A default as a YAML value reads."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _choices(hint) -> tuple:
    """The values of a Literal type, also inside a union (`int | Literal["auto"]`)."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(c for arg in typing.get_args(hint) for c in _choices(arg))


def config_keys(source: str | None = None) -> list[Key]:
    """Every key of the run config, in the order config.py declares them: section by section under `Config`
    (a nested dataclass, model.tiny, is walked as a section of its own). `source`: config.py's text (default: the
    file's)."""
    docs = attribute_docs(CONFIG_SOURCE.read_text() if source is None else source)
    keys: list[Key] = []

    def walk(cls, instance, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), value, f"{prefix}{f.name}.")
                continue
            annotation, doc = docs.get(cls.__name__, {}).get(f.name, ("", ""))
            keys.append(Key(prefix + f.name, annotation, yaml_value(value), _choices(hints[f.name]), doc))
    walk(Config, Config(), "")
    return keys


def undocumented_keys(source: str | None = None) -> list[str]:
    """The config keys whose field has no docstring."""
    return [k.key for k in config_keys(source) if not k.doc]


def section_docs() -> dict[str, str]:
    """{section: its dataclass's docstring} for the sections under Config (model.tiny included)."""
    out = {}

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            sub = typing.get_type_hints(cls)[f.name]
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                out[prefix + f.name] = " ".join((sub.__doc__ or "").split()) if sub.__doc__ and \
                    not sub.__doc__.startswith(sub.__name__ + "(") else ""
                walk(sub, f"{prefix}{f.name}.")
    walk(Config, "")
    return out


def describe(key: Key) -> str:
    """One key's entry as `jetflow config explain` prints it."""
    lines = [key.key, f"  type:    {key.type}", f"  default: {key.default}"]
    if key.choices:
        lines.append("  valid:   " + ", ".join(str(c) for c in key.choices))
    return "\n".join(lines + ["", *_wrap(key.doc or "(undocumented)", "  ")])


def explain(name: str) -> str:
    """The reference entry of config key `name` (`algo.kl_coef`); for a section (`algo`) its description and the
    entry of each of its keys. An unknown name is a one-line ConfigError suggesting the closest key."""
    keys, sections = config_keys(), section_docs()
    by_name = {k.key: k for k in keys}
    if name in by_name:
        return describe(by_name[name])
    if name in sections:
        inside = [k for k in keys if k.key.rsplit(".", 1)[0] == name]
        head = [f"[{name}]", *_wrap(sections[name], "  ")] if sections[name] else [f"[{name}]"]
        return "\n\n".join(["\n".join(head), *(describe(k) for k in inside)])
    raise ConfigError(f"unknown config key {name!r}{_suggestion(name, [*by_name, *sections])} "
                      "(`jetflow config` prints every key with its value)")


def _suggestion(name: str, names: list[str]) -> str:
    """'; did you mean X?' for the name closest to `name` (difflib), also by its last part alone (`kl_coef`)."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not close:
        last = {n.rsplit(".", 1)[-1]: n for n in reversed(names)}  # the first key of a last part wins
        close = [last[m] for m in difflib.get_close_matches(name.rsplit(".", 1)[-1], list(last), n=1, cutoff=0.6)]
    return f"; did you mean {close[0]}?" if close else ""


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent)
