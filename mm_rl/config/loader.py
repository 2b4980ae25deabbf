"""Load a job yaml: schema defaults <- yaml <- ``--a.b.c=value`` overrides, ``${...}`` resolved, types checked.

Every problem is collected (unknown keys with the nearest valid key, values of the wrong type, interpolations
that do not resolve) and raised together as one ``ConfigError``, before anything expensive starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mm_rl.config.schema import JobConfig, defaults, yaml_key


@dataclass(frozen=True)
class Violation:
    """One broken rule: where, what was given, which rule, and how to fix it."""

    key: str
    value: Any
    rule: str
    fix: str
    via: str | None = dataclasses.field(default=None, compare=False, repr=False)  # the ${...} it came through

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.rule}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A job config that breaks one or more rules; ``violations`` lists them all."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = list(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} problem(s) in the job config:\n{lines}")


def parse_overrides(args: Sequence[str]) -> list[str]:
    """``--a.b=1``, ``a.b=1`` and ``--a.b 1`` -> ``["a.b=1"]``; anything else is a ConfigError."""
    out: list[str] = []
    items = list(args)
    while items:
        item = items.pop(0)
        body = item[2:] if item.startswith("--") else item
        if "=" in body:
            out.append(body)
        elif item.startswith("--") and items and not items[0].startswith("--"):
            out.append(f"{body}={items.pop(0)}")
        else:
            raise ConfigError([Violation(item, None, "an override needs a value",
                                         f"write --{body}=VALUE (a dotted key path, e.g. --env.NNODES=2)")])
    return out


def compose(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Schema defaults <- yaml file <- overrides, unresolved (``${...}`` kept, as a user would write it)."""
    layers: list[DictConfig] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([Violation("job yaml", str(path), "file not found",
                                         "pass an existing yaml, or write one with `ascendfactory-cli config`")])
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # yaml syntax errors come in several exception types
            raise ConfigError([Violation("job yaml", str(path), f"not valid yaml ({err})",
                                         "fix the yaml syntax at the position named")]) from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError([Violation("job yaml", str(path), "the top level must be a mapping",
                                         "start from `ascendfactory-cli config`")])
        layers.append(loaded)
    try:
        layers.append(OmegaConf.from_dotlist(list(parse_overrides(overrides))))
    except OmegaConfBaseException as err:
        raise ConfigError([Violation("overrides", list(overrides), str(err).splitlines()[0],
                                     "write --a.b.c=VALUE")]) from None
    problems = [v for layer in layers for v in unknown_keys(layer)]
    if problems:
        raise ConfigError(problems)
    return typing.cast(DictConfig, OmegaConf.merge(OmegaConf.create(defaults()), *layers))


def load_job(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Compose, resolve and type-check a job; raises ConfigError listing every problem."""
    return to_job(compose(path, overrides))


def to_job(node: DictConfig) -> JobConfig:
    problems: list[Violation] = []
    job = _build(JobConfig, node, "", problems)
    if problems:
        raise ConfigError(_drop_echoes(problems))
    return job


def load_section(cls: type, data: dict[str, Any]) -> Any:
    """One schema section (e.g. ``ModelConfig`` from a model.json dict), defaults filled, types checked."""
    node = OmegaConf.create(data)
    problems = unknown_keys(node, cls)
    node = OmegaConf.merge(OmegaConf.create(defaults(cls)), node)
    section = _build(cls, node, "", problems)
    if problems:
        raise ConfigError(problems)
    return section


def _drop_echoes(problems: list[Violation]) -> list[Violation]:
    """A bad value reported at its source is not reported again at every key that interpolates it."""
    sources = {v.key for v in problems if v.via is None}
    return [v for v in problems if v.via not in sources]


# ------------------------------------------------------------------------------------- unknown keys
def all_key_paths(cls: type = JobConfig, prefix: str = "", sources_only: bool = False) -> Iterator[str]:
    """Every key path of the schema; ``sources_only`` leaves out keys that follow another by ``${...}``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{yaml_key(f)}"
        if not (sources_only and "ref" in f.metadata):
            yield path
        if dataclasses.is_dataclass(hints[f.name]):
            yield from all_key_paths(hints[f.name], path + ".", sources_only)


def _norm(key: str) -> str:
    return key.lower().replace("-", "_")


def suggest(path: str, siblings: Sequence[str]) -> str:
    """The valid key a user most likely meant by ``path``: a sibling spelled alike, else the same name elsewhere."""
    leaf = path.rsplit(".", 1)[-1]
    prefix = path[: len(path) - len(leaf)]
    by_norm = {_norm(s): s for s in siblings}
    close = difflib.get_close_matches(_norm(leaf), list(by_norm), n=1, cutoff=0.6)
    if close:
        return prefix + by_norm[close[0]]
    elsewhere = [p for p in all_key_paths(sources_only=True) if _norm(p.rsplit(".", 1)[-1]) == _norm(leaf)]
    return elsewhere[0] if elsewhere else ""


def unknown_keys(node: DictConfig, cls: type = JobConfig, prefix: str = "") -> list[Violation]:
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    problems: list[Violation] = []
    for key in node.keys():
        path = f"{prefix}{key}"
        field = fields.get(str(key))
        if field is None:
            guess = suggest(path, list(fields))
            fix = f"did you mean '{guess}'?" if guess else f"valid keys here: {', '.join(fields)}"
            problems.append(Violation(path, _raw(node, key), "unknown key", fix))
            continue
        sub = node._get_node(key)
        if dataclasses.is_dataclass(hints[field.name]) and isinstance(sub, DictConfig):
            problems += unknown_keys(sub, hints[field.name], path + ".")
    return problems


def _raw(node: DictConfig, key: Any) -> Any:
    value = node._get_node(key)
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value._value()


# ------------------------------------------------------------------------------------ typed building
def _build(cls: type, node: Any, prefix: str, problems: list[Violation]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = yaml_key(f)
        path = f"{prefix}{key}"
        tp = hints[f.name]
        try:
            value = node[key]
        except OmegaConfBaseException as err:
            problems.append(Violation(path, _raw(node, key), f"does not resolve ({str(err).splitlines()[0]})",
                                      "point the ${...} at an existing key or write the value"))
            continue
        if dataclasses.is_dataclass(tp):
            if isinstance(value, DictConfig):
                kwargs[f.name] = _build(tp, value, path + ".", problems)
            else:
                problems.append(Violation(path, value, "must be a mapping (a section)", f"see {path} in the template"))
            continue
        if isinstance(value, ListConfig):
            value = OmegaConf.to_container(value, resolve=True)
        ok, coerced = coerce(value, tp)
        if ok:
            kwargs[f.name] = coerced
            continue
        raw = str(node._get_node(key)._value())
        via = raw[2:-1] if raw.startswith("${") and raw.endswith("}") else None
        problems.append(Violation(path, value, f"expected {describe(tp)}", f"write {describe(tp)}", via))
    return cls(**kwargs)


def coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check ``value`` against a schema type, converting only where it loses nothing (int -> float)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return type(None) in args, None
        return next(((True, v) for ok, v in (coerce(value, a) for a in args if a is not type(None)) if ok),
                    (False, value))
    if origin is Literal:
        return value in args, value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return True, value


def describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {describe(args[0])}s"
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))
