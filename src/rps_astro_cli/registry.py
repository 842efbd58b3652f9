"""A tiny decorator registry shared by every plugin family (dispatch policy, instance
policy, engine backend, dataset, length model)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from rps_astro_cli.errors import AstroUserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → factory map with decorator registration.

    `get(name)` raises `AstroUserError` listing the valid names when `name` is unknown.
    """

    def __init__(self, family: str):
        self.family = family
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise RuntimeError(f"{self.family} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise AstroUserError(
                f"unknown {self.family} {name!r}",
                field=self.family,
                fix=f"choose one of: {', '.join(sorted(self._items))}",
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


class PluginImportError(ImportError):
    """A plug-in module failed to import; the message names the module and the family,
    so a broken policy module is never mistaken for an "unknown policy"."""


def import_plugins(family: str, modules: Iterable[str]) -> None:
    """Import each module (which registers its plug-ins by decorator), loudly.

    Raises:
        PluginImportError: naming the first module that failed and why (the original
            exception is chained).
    """
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:
            raise PluginImportError(f"{family} module {mod} failed to import: {type(exc).__name__}: {exc}",
                                    name=mod) from exc
