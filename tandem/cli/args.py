"""Command-line options generated from the pydantic config models, so defaults live in one place."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Literal, get_args, get_origin

from pydantic import BaseModel


def _scalar_type(annotation):
    """(python type, choices) for an annotation like `int | None` or `Literal["a", "b"]`."""
    origin = get_origin(annotation)
    if origin is list:
        return _scalar_type(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _scalar_type(inner[0]) if len(inner) == 1 else (str, None)
    if origin is Literal:
        choices = list(get_args(annotation))
        return type(choices[0]), choices
    return annotation, None


def add_model_options(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """One `--kebab-case` option per scalar field of `model` (nested models are left to the caller)."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        py_type, choices = _scalar_type(field.annotation)
        if isinstance(py_type, type) and issubclass(py_type, BaseModel):
            continue
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        # %(default)s, not the value: argparse then prints it once, whatever the formatter or action adds.
        help_text = f"{field.description or ''} (default: %(default)s)".strip()
        if get_origin(field.annotation) is list:
            parser.add_argument(flag, dest=name, type=py_type, nargs="*", default=default, help=help_text)
        elif py_type is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=py_type, choices=choices, default=default, help=help_text)


def model_from_options(model: type[BaseModel], ns: argparse.Namespace, **extra) -> BaseModel:
    values = {name: getattr(ns, name) for name in model.model_fields if hasattr(ns, name)}
    values.update(extra)
    return model(**values)


def options_to_args(instance: BaseModel) -> list[str]:
    """The command-line options that reproduce `instance`'s non-default scalar fields (to pass a
    config on to a child process)."""
    args: list[str] = []
    for name, field in type(instance).model_fields.items():
        value = getattr(instance, name)
        if isinstance(value, BaseModel) or value == field.get_default(call_default_factory=True):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        elif value is not None:
            args += [flag, str(value)]
    return args
