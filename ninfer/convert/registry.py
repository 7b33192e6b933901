"""The recipe registry: recipes register by name; `get_recipe` imports the built-in recipe modules once."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from ninfer.errors import ConversionError

_RECIPES: dict[str, Recipe] = {}
_BUILTIN_MODULES = ("ninfer.convert.recipes.qwen3_5", "ninfer.convert.recipes.dense")


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable  # build(job: ConversionJob) -> None
    sources: tuple[str, ...]  # the --source names it reads
    architecture: str  # the text architecture it produces ("qwen3_5", "qwen2", "llama")
    description: str = ""


def recipe(name: str, *, sources: tuple[str, ...], architecture: str, description: str = "") -> Callable:
    """Decorator registering `build(job)` as recipe `name`."""

    def register(build: Callable) -> Callable:
        if name in _RECIPES:
            raise ValueError(f"recipe {name!r} registered twice")
        _RECIPES[name] = Recipe(name, build, tuple(sources), architecture, description)
        return build

    return register


def _load_builtin() -> None:
    for module in _BUILTIN_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def recipe_names() -> list[str]:
    _load_builtin()
    return sorted(_RECIPES)


def get_recipe(name: str) -> Recipe:
    _load_builtin()
    if name not in _RECIPES:
        raise ConversionError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(_RECIPES))}")
    return _RECIPES[name]
