"""The command line, made from the config's fields (as vLLM's EngineArgs and mini-sglang's ServerArgs): each option
field of ServerConfig (the engine's, the visual process's and the server's) is one flag, LightLLM's name, so that its
launch lines work unchanged, with vLLM's spelling as an alias where users know it. Name, type, default and help are
written once, on the field; this module only reads them."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from mmserve.launch.config import ServerConfig

# The --help groups, in the order shown (each field's metadata names its own)
GROUPS = ("serving", "model", "KV cache and scheduling", "vision", "parallelism", "limits and timeouts")
_METAVARS = {int: "N", float: "X", str: "STR"}


class _HelpFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=40)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        """`--tp, --tensor-parallel-size N`: the value's name once, after the flag and its aliases."""
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not the usage of every flag (dozens of lines, the error last), then exit 2 as argparse does."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def option_fields() -> list[dataclasses.Field]:
    """ServerConfig's fields that are flags (the others, e.g. startup_timeout_s, are set in code): the server's own
    first (--model_dir before the engine's model options), then the engine's and the visual process's."""
    options = [f for f in dataclasses.fields(ServerConfig) if "help" in f.metadata]
    return sorted(options, key=lambda f: f.name not in ServerConfig.__annotations__)


def flag_names(f: dataclasses.Field) -> list[str]:
    """The field's flag, then its aliases."""
    return [f"--{f.metadata.get('flag', f.name)}", *f.metadata.get("aliases", ())]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mmserve",
        description="Serve a (multimodal) LLM over HTTP, LightLLM-style.",
        usage="%(prog)s [--model_dir DIR] [--enable_multimodal] [options]",
        formatter_class=_HelpFormatter,
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    hints = typing.get_type_hints(ServerConfig)
    for f in option_fields():
        group = f.metadata["group"]
        if group not in groups:
            raise ValueError(f"{f.name}: --help group {group!r} is not one of {GROUPS}")
        groups[group].add_argument(*flag_names(f), dest=f.name, **_argument(f, hints[f.name]))
    return p


def _argument(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """add_argument's keywords for a field: a bool is a switch that flips its default; any other value shows its
    default in --help (a None default's help says what omitting the flag means)."""
    help = f.metadata["help"].replace("%", "%%")
    if hint is bool:
        return {"action": "store_false" if f.default else "store_true", "default": f.default, "help": help}
    value_type = _value_type(hint)
    kwargs = {"type": value_type, "default": f.default, "help": help, "metavar": _METAVARS.get(value_type)}
    if f.default is not None:
        kwargs["help"] = f"{help} (default: {f.default})"
    for key in ("choices", "nargs"):
        if key in f.metadata:
            kwargs[key] = f.metadata[key]
    if "choices" in kwargs:
        del kwargs["metavar"]  # argparse shows the choices
    return kwargs


def _non_none(hint: Any) -> Any:
    """int for `int | None`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) < len(typing.get_args(hint)) else hint


def _value_type(hint: Any) -> type:
    """What one command-line word becomes: int for `int`, `int | None` and `tuple[int, ...] | None`."""
    hint = _non_none(hint)
    return typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint


def _field_value(hint: Any, value: Any) -> Any:
    """A nargs='+' flag's words: a tuple field takes them all; a single-value field the first (LightLLM's
    --vit_att_backend takes one per data-parallel vision tower, and there is one tower)."""
    if not isinstance(value, list):
        return value
    return tuple(value) if typing.get_origin(_non_none(hint)) is tuple else value[0]


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    hints = typing.get_type_hints(ServerConfig)
    try:
        return ServerConfig(**{name: _field_value(hints[name], value) for name, value in args.items()})
    except ValueError as e:
        parser.error(str(e))
