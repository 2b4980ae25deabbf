"""Load a job yaml: schema defaults <- yaml <- ``--a.b.c=value`` overrides, ``${...}`` resolved, types checked.

Every problem is collected (unknown keys with the nearest valid key, values of the wrong type, interpolations
that do not resolve, followers set apart from the key they repeat) and raised together as one ``ConfigError``,
before anything expensive starts. ``check_job`` adds the validation rules to the same error: a broken key does not
hide them.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
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
    meant: str | None = dataclasses.field(default=None, compare=False, repr=False)  # an unknown key's likely meaning

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
            out.append(_whole_value(body))
        elif item.startswith("--") and items and not items[0].startswith("--"):
            out.append(_whole_value(f"{body}={items.pop(0)}"))
        else:
            raise ConfigError(
                [
                    Violation(
                        item,
                        None,
                        "an override needs a value",
                        f"write --{body}=VALUE (a dotted key path, e.g. --env.NNODES=2)",
                    )
                ]
            )
    return out


def _whole_value(override: str) -> str:
    """``key=value`` unchanged, unless the key picks one element of a list (``a.b.0=5``, ``a.b[0]=5``): a
    ConfigError that asks for the whole list (every list of the job is short: its values read best together)."""
    key, _, value = override.partition("=")
    parts = re.split(r"\.|\[", key)
    index = next((i for i, part in enumerate(parts) if part.rstrip("]").isdigit()), None)
    if index is None:
        return override
    whole = ".".join(parts[:index])
    raise ConfigError([Violation(
        key, value, "an override sets a whole value, not one element of a list",
        f"give the whole list, e.g. --{whole}='[1,2,3]' (quoted for the shell)",
    )])  # fmt: skip


def relative_note(path: str | Path) -> str:
    """Where a relative path is looked up, for messages: nothing resolves the job's paths against the yaml's
    directory; the rules and ``submit`` take them from the current working directory."""
    if Path(path).is_absolute():
        return ""
    return f" (relative to the current working directory, {Path.cwd()})"


def read_layers(path: str | Path | None = None, overrides: Sequence[str] = ()) -> list[DictConfig]:
    """The yaml file and the overrides as unmerged layers; a ConfigError only for what cannot be read at all."""
    layers: list[DictConfig] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                [
                    Violation(
                        "job yaml",
                        str(path),
                        f"file not found{relative_note(path)}",
                        "pass an existing yaml, or write one with `ascendfactory-cli config`",
                    )
                ]
            )
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # yaml syntax errors come in several exception types
            raise ConfigError(
                [
                    Violation(
                        "job yaml", str(path), f"not valid yaml ({err})", "fix the yaml syntax at the position named"
                    )
                ]
            ) from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(
                [
                    Violation(
                        "job yaml",
                        str(path),
                        "the top level must be a mapping",
                        "start from `ascendfactory-cli config`",
                    )
                ]
            )
        layers.append(loaded)
    try:
        layers.append(OmegaConf.from_dotlist(list(parse_overrides(overrides))))
    except OmegaConfBaseException as err:
        raise ConfigError(
            [Violation("overrides", list(overrides), str(err).splitlines()[0], "write --a.b.c=VALUE")]
        ) from None
    return layers


def compose(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Schema defaults <- yaml file <- overrides, unresolved (``${...}`` kept, as a user would write it)."""
    layers = read_layers(path, overrides)
    problems = [v for layer in layers for v in unknown_keys(layer)]
    if problems:
        raise ConfigError(problems)
    return typing.cast(DictConfig, OmegaConf.merge(OmegaConf.create(defaults()), *layers))


def load_job(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Compose, resolve and type-check a job; raises ConfigError listing every problem."""
    return to_job(compose(path, overrides))


Rules = Callable[[JobConfig], Iterable[Violation]]


def load_checked(path: str | Path | None, overrides: Sequence[str], rules: Rules) -> tuple[DictConfig, JobConfig]:
    """``compose``, ``to_job`` and ``rules`` in one pass: one ConfigError with every problem (see ``check_job``)."""
    return check_job(OmegaConf.create(defaults()), read_layers(path, overrides), rules)


def check_job(base: DictConfig, layers: Sequence[DictConfig], rules: Rules) -> tuple[DictConfig, JobConfig]:
    """``base`` (the schema defaults, or a planned job) with the user's ``layers`` merged on top, and its job; else
    one ConfigError holding every problem of the layers and every rule violation.

    A broken key (unknown, of the wrong type, unresolvable, a changed follower) does not hide the rules: the rules
    run on the job with ``base``'s values in place of the broken ones (an unknown key's likely meaning keeps its
    ``base`` value too), and only the violations at a broken key, or at a key that follows one through ``${...}``,
    are dropped: they would judge a value the user did not give.
    """
    found = [v for layer in layers for v in unknown_keys(layer)]
    node = typing.cast(DictConfig, OmegaConf.merge(base, *layers))
    job, problems, broken = _repair(node, base)
    found += problems
    hidden = _dependents(node, broken | {v.meant for v in found if v.meant})
    found += [v for v in rules(job) if not _within(v.key, hidden)]
    if found:
        raise ConfigError(found)
    return node, job


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


# Keys that earlier versions wrote into job yamls and that are gone: why, and what to do.
_RENDEZVOUS = (
    "removed: mm_rl's ranks find each other through Ray (rank 0's node address and a port free there), so "
    "no rendezvous address is set; a multi-node job joins its cluster with env.RAY_ADDRESS (or submit); "
    "delete the line"
)
RETIRED = {
    "backend_config.actor_config.recompute_activations": "removed: it never had an effect (activation recompute "
    "is not implemented); delete the line",
    "env.MASTER_ADDR": _RENDEZVOUS,
    "env.MASTER_PORT": _RENDEZVOUS,
}


def unknown_keys(node: DictConfig, cls: type = JobConfig, prefix: str = "") -> list[Violation]:
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    problems: list[Violation] = []
    for key in node.keys():
        path = f"{prefix}{key}"
        field = fields.get(str(key))
        if field is None:
            guess = "" if path in RETIRED else suggest(path, list(fields))
            fix = RETIRED.get(path) or (
                f"did you mean '{guess}'?" if guess else f"valid keys here: {', '.join(fields)}"
            )
            problems.append(Violation(path, _raw(node, key), "unknown key", fix, meant=guess or None))
            continue
        sub = node._get_node(key)
        if dataclasses.is_dataclass(hints[field.name]) and isinstance(sub, DictConfig):
            problems += unknown_keys(sub, hints[field.name], path + ".")
    return problems


def _raw(node: DictConfig, key: Any) -> Any:
    value = node._get_node(key)
    return OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value._value()


# ------------------------------------------------------------------------------------------ followers
def followers(cls: type = JobConfig, prefix: str = "") -> dict[str, str]:
    """Each key that repeats another (a ``ref`` to a plain ``${key}``), with the key it repeats. A ``ref`` with a
    template (``${af_output_dir}/ckpt``) only derives a default and may be set freely."""
    hints = typing.get_type_hints(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{yaml_key(f)}"
        plain = re.fullmatch(r"\$\{(\.?)([^${}]+)\}", f.metadata.get("ref", ""))
        if plain:
            out[path] = (prefix if plain[1] else "") + plain[2]
        if dataclasses.is_dataclass(hints[f.name]):
            out |= followers(hints[f.name], path + ".")
    return out


FOLLOWERS = followers()


def source_of(key: str) -> str:
    """The key where a repeated value is set (followed through followers of followers)."""
    while key in FOLLOWERS:
        key = FOLLOWERS[key]
    return key


def _changed_follower(job: JobConfig, key: str) -> Violation:
    source = source_of(key)
    return Violation(
        key,
        _get(job, key),
        f"repeats {source} = {_get(job, source)!r}, which is where this value is set",
        f"set {source} instead, and remove {key} from the yaml / overrides so that it follows",
    )


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, {yaml_key(f): f.name for f in dataclasses.fields(obj)}[part])
    return obj


# ------------------------------------------------------------------------- repairing, what depends on what
_REPAIR_ROUNDS = 8  # types, then followers, then followers of reset followers: a few rounds settle any job


def _repair(node: DictConfig, base: DictConfig) -> tuple[JobConfig, list[Violation], set[str]]:
    """The job of ``node`` with each broken value (wrong type, unresolvable, a follower set apart from its source)
    taken from ``base`` instead, the problems found, and the keys so reset."""
    fixed = copy.deepcopy(node)
    found: list[Violation] = []
    broken: set[str] = set()
    for _ in range(_REPAIR_ROUNDS):
        problems: list[Violation] = []
        job = _build(JobConfig, fixed, "", problems)
        reset = [v.key for v in problems]
        if not problems:  # followers are compared once every value has its type
            reset = [k for k, s in FOLLOWERS.items() if _get(job, k) != _get(job, s)]
            # a follower of a broken source is only reset: its source's own error speaks
            problems = [_changed_follower(job, k) for k in reset if not _within(source_of(k), broken)]
        if not reset:
            return job, _drop_echoes(found), broken
        found += problems
        broken.update(reset)
        for key in reset:
            parent, _, leaf = key.rpartition(".")
            OmegaConf.update(fixed, key, _raw(OmegaConf.select(base, parent) if parent else base, leaf), merge=False)
    raise ConfigError(_drop_echoes(found))


def _references(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(key, key it interpolates) for every ``${...}`` in ``node``; relative ones (``${.x}``) made absolute."""
    for key in node.keys():
        path = f"{prefix}{key}"
        if isinstance(node._get_node(key), DictConfig):
            yield from _references(typing.cast(DictConfig, node._get_node(key)), path + ".")
            continue
        for ref in re.findall(r"\$\{([^${}:]+)\}", str(_raw(node, key))):
            name = ref.lstrip(".")
            up = len(ref) - len(name)
            parts = prefix.split(".")[:-1]
            yield path, ".".join([*(parts[: len(parts) - up + 1] if up else []), name])


def _dependents(node: DictConfig, keys: set[str]) -> set[str]:
    """``keys`` and every key of ``node`` that interpolates one of them, directly or through others."""
    refs = list(_references(node))
    out = set(keys)
    grown = True
    while grown:
        new = {key for key, source in refs if key not in out and _within(source, out)}
        out |= new
        grown = bool(new)
    return out


def _within(key: str, keys: set[str]) -> bool:
    """``key`` is one of ``keys`` or lies in a section among them."""
    return any(key == k or key.startswith(k + ".") for k in keys)


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
            problems.append(
                Violation(
                    path,
                    _raw(node, key),
                    f"does not resolve ({str(err).splitlines()[0]})",
                    "point the ${...} at an existing key or write the value",
                )
            )
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
        return next(
            ((True, v) for ok, v in (coerce(value, a) for a in args if a is not type(None)) if ok), (False, value)
        )
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
