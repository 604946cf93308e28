"""Which methods read each generic run-config key, declared on its field of :class:`experiment.config.RunConfig`.

A generic key read by only some methods lists them in its field's ``json_schema_extra`` under
:data:`METHODS_EXTRA` (:func:`readers`), derived from registry facts (:func:`methods_where`,
:func:`methods_on`) so that a new method's entry updates every list. A settings group's keys are
derived from the entries that name the group instead (:mod:`experiment.method_settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pydantic.config import JsonDict, JsonValue

from experiment import registry
from experiment.method_settings import ALLOWED_EXTRA

#: The ``json_schema_extra`` entry of a field that lists the methods reading its key (registry
#: names, registration order); a field without it is read by every method.
METHODS_EXTRA = "methods"


def methods_where(keep: Callable[[registry.MethodEntry], bool]) -> list[str]:
    """Registered method names (registration order) whose entry ``keep`` accepts."""
    return [e.name for e in registry.METHODS.values() if keep(e)]


def methods_on(*families: registry.FamilyKind) -> list[str]:
    """The methods that run on at least one of ``families``."""
    return methods_where(lambda e: not e.families.isdisjoint(families))


def readers(methods: Iterable[str] | None = None, *, allowed: str = "") -> JsonDict:
    """A field's ``json_schema_extra``: the methods that read its key (``None``: all) and its accepted values."""
    extra: JsonDict = {}
    if methods is not None:
        names: list[JsonValue] = list(dict.fromkeys(methods))
        extra[METHODS_EXTRA] = names
    if allowed:
        extra[ALLOWED_EXTRA] = allowed
    return extra


#: Image models: every family but the transformers.
IMAGE_METHODS = methods_on("cnn", "architectures", "codist")
#: Methods whose tiers can be widths: HeteroFL / FedRolex, and every method a CNN runs with its
#: own width variants (not one with models of its own, DepthFL's depths).
WIDTH_TIER_METHODS = methods_where(lambda e: e.width_tiers or ("cnn" in e.families and e.family_hook is None))
