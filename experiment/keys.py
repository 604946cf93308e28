"""The run-config key reference, read from where the keys are defined (:class:`~experiment.config.RunConfig`).

Every field of the run config carries its description, and, where not every method reads it,
the methods that do (:data:`experiment.config.KEY_METHODS`); its type, default and
constraints are the field's own.  This module turns them into a reference::

    python -m experiment.keys                    # every key, for the console
    python -m experiment.keys --method heterofl  # the keys heterofl reads (generic ones included)
    python -m experiment.keys --markdown > docs/CONFIG_KEYS.md

``docs/CONFIG_KEYS.md`` is that last command's output; ``tests/test_config_keys.py`` keeps it
current.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import annotated_types
from pydantic.fields import FieldInfo

from experiment import registry
from experiment.config import KEY_METHODS, RunConfig
from experiment.method_settings import ALLOWED_EXTRA, GROUPS, group_of

#: The command that writes the docs page (named in the page's header).
MARKDOWN_COMMAND = "python -m experiment.keys --markdown > docs/CONFIG_KEYS.md"


@dataclass(frozen=True)
class KeyInfo:
    """One run-config key, as the reference shows it.

    Attributes
    ----------
    key : str
        The flat kebab-case key (``num-server-rounds``).
    type : str
        ``"int"``, ``"float"``, ``"str"`` or ``"bool"`` (a choice of strings: ``"str"``).
    default : str
        The default as a TOML value (``7``, ``'iid'``, ``true``).
    allowed : str
        The accepted values: the choices, the bounds (``">= 1"``, ``"0 < x <= 1"``) or the
        field's own words; ``""`` when any value of the type is.
    methods : str
        The methods that read the key: ``"all"``, ``"all but a, b"`` or a list.
    description : str
        What the key does and when it has an effect.

    """

    key: str
    type: str
    default: str
    allowed: str
    methods: str
    description: str


def toml_value(value: object) -> str:
    """``value`` written as in a TOML file or a ``--run-config`` override (strings single-quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def bounds_text(info: FieldInfo) -> str:
    """The field's numeric constraints: ``">= 1"``, ``"> 0"``, ``"<= 1"`` or ``"0 <= x < 1"``; ``""`` if none."""
    low: tuple[str, str] | None = None  # (bound, "<=" or "<"), read as "bound op x"
    high: tuple[str, str] | None = None  # ("<=" or "<", bound), read as "x op bound"
    for c in info.metadata:
        if isinstance(c, annotated_types.Ge):
            low = (_number(c.ge), "<=")
        elif isinstance(c, annotated_types.Gt):
            low = (_number(c.gt), "<")
        elif isinstance(c, annotated_types.Le):
            high = ("<=", _number(c.le))
        elif isinstance(c, annotated_types.Lt):
            high = ("<", _number(c.lt))
    if low and high:
        return f"{low[0]} {low[1]} x {high[0]} {high[1]}"
    if low:
        return f"{low[1].replace('<', '>')} {low[0]}"
    return f"{high[0]} {high[1]}" if high else ""


def choices(info: FieldInfo) -> tuple[object, ...]:
    """The values of a ``Literal`` field; ``()`` for any other type."""
    if typing.get_origin(info.annotation) is typing.Literal:
        return typing.get_args(info.annotation)
    return ()


def type_name(info: FieldInfo) -> str:
    """``"int"``, ``"float"``, ``"str"`` or ``"bool"``: the field's type (a ``Literal``'s: its values' type)."""
    values = choices(info)
    annotation = type(values[0]) if values else info.annotation
    return getattr(annotation, "__name__", str(annotation))


def allowed_text(info: FieldInfo) -> str:
    """What the field accepts: its choices, its bounds, or the words its field declares (``""``: any)."""
    values = choices(info)
    if values:
        return ", ".join(toml_value(v) for v in values)
    extra = info.json_schema_extra
    words = extra.get(ALLOWED_EXTRA) if isinstance(extra, dict) else None
    return " ".join(x for x in (bounds_text(info), str(words or "")) if x)


def methods_text(methods: Sequence[str] | None) -> str:
    """``"all"`` (``None``), the methods, or ``"all but ..."`` when at most half as many are left out."""
    if methods is None:
        return "all"
    left_out = [m for m in registry.METHODS if m not in methods]
    if not left_out:
        return "all"
    if 2 * len(left_out) <= len(methods):
        return "all but " + ", ".join(left_out)
    return ", ".join(methods)


def key_info(key: str, info: FieldInfo) -> KeyInfo:
    """The reference entry of the field ``info`` (run-config key ``key``)."""
    return KeyInfo(
        key=key,
        type=type_name(info),
        default=toml_value(info.default),
        allowed=allowed_text(info),
        methods=methods_text(KEY_METHODS.get(key)),
        description=info.description or "",
    )


def applies(key: str, method: str) -> bool:
    """Whether ``method`` reads ``key`` (every method reads a key its field names no methods for)."""
    methods = KEY_METHODS.get(key)
    return methods is None or method in methods


def key_reference(method: str | None = None) -> list[KeyInfo]:
    """Every run-config key (generic ones in definition order, then each settings group's), or those ``method`` reads.

    Parameters
    ----------
    method : str, optional
        A registered method: keep the keys it reads, the generic ones included.

    Raises
    ------
    experiment.registry.UnknownMethod
        For a method the registry does not hold (naming the closest one).

    """
    if method is not None:
        registry.lookup(method)
    out = []
    fields = RunConfig.model_fields
    generic = [name for name in fields if group_of(name) is None]
    for name in [*generic, *(n for group in GROUPS for n in group.model_fields)]:
        info = fields[name]
        key = info.alias or name
        if method is None or applies(key, method):
            out.append(key_info(key, info))
    return out


def _wrap(text: str, width: int, first: str = "    ") -> str:
    return textwrap.fill(text, width=width, initial_indent=first, subsequent_indent="    ", break_on_hyphens=False)


def render_text(method: str | None = None, *, width: int = 100) -> str:
    """The reference for the console, one block per key.

    ``key = default  (type; allowed values)``, then the methods that read it and what it does,
    wrapped at ``width`` columns.
    """
    blocks = []
    for k in key_reference(method):
        head = f"{k.key} = {k.default}  ({'; '.join(x for x in (k.type, k.allowed) if x)})"
        parts = (_wrap(head, width, first=""), _wrap(f"methods: {k.methods}", width), _wrap(k.description, width))
        blocks.append("\n".join(parts))
    return "\n\n".join(blocks) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def render_markdown(method: str | None = None) -> str:
    """The reference as a Markdown page (``docs/CONFIG_KEYS.md`` is the one for every method)."""
    command = MARKDOWN_COMMAND if method is None else f"python -m experiment.keys --method {method} --markdown"
    title = "Run-config keys" + ("" if method is None else f" read by `{method}`")
    lines = [
        f"# {title}",
        "",
        f"Generated by `{command}` from `experiment/config.py`; do not edit by hand.",
        "",
        "Set a key in `[tool.flwr.app.config]` of `pyproject.toml` (the defaults below), in a run-config "
        'file (`--config`) or as an override (`--run-config "key=value"`). *Methods* names the methods that '
        "read a key (`all`: every method); `python -m experiment.keys --method M` lists the keys of method `M`.",
        "",
        "| Key | Type | Default | Allowed | Methods | Description |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in key_reference(method):
        cells = (_code(k.key), k.type, _code(k.default), k.allowed, k.methods, k.description)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the reference (``--method``: one method's keys; ``--markdown``: as Markdown); 2 for an unknown method."""
    parser = argparse.ArgumentParser(
        prog="python -m experiment.keys",
        description="Print every run-config key: type, default, allowed values, the methods that read it "
        "and what it does.",
    )
    parser.add_argument("--method", help="only the keys this registered method reads (generic keys included)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown (docs/CONFIG_KEYS.md)")
    args = parser.parse_args(argv)
    try:
        text = render_markdown(args.method) if args.markdown else render_text(args.method)
    except registry.UnknownMethod as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
