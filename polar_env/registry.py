"""``Registry[T]``: the one shape behind every name → thing table (providers, engines, runtimes,
harnesses, builders, evaluators).

A registry maps a name to a value and, optionally, the pydantic model of the params that value
takes, so a config or ``TaskRequest`` can check both the name and its params when it is built,
long before any session starts. An unknown name is a ``ConfigError`` of one line naming the kind,
the bad value and the closest valid names. Registries that allow it (``load=``) also resolve an
import path ``pkg.module:attr``. Adding one more entry is one ``register`` call (or decorator)
next to the table.

A registry of things that need this host (engines, harnesses, runtimes, evaluators) is built with
``preflight=``: each entry then carries its own preflight check (``Entry.preflight``, a function
raising ``ConfigError`` in one line when the host cannot run it), which ``polar_env/preflight.py``
runs for every name a job uses. With ``preflight=True`` an entry registered without one is refused
in one line, so a new kind cannot be skipped by the preflight; a function is the check of entries
that declare none (and of those loaded by import path).

``validation_line`` turns a pydantic ``ValidationError`` into the same kind of one line.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, get_args, overload

from pydantic import BaseModel, ValidationError, ValidationInfo

from polar_env.errors import ConfigError

T = TypeVar("T")
V = TypeVar("V")

Preflight = Callable[..., None]
"""A preflight check: raises ``ConfigError`` (one line: what, where, how to fix) when this host
cannot run the entry; each registry documents what its checks are called with."""

NAMES_CHECKED = {"names_checked": True}
"""Validation context for a model that was already checked where it was built: a node
deserializing a ``SessionSpec`` in another process (where a name registered only in the
submitting process, such as a custom evaluator in ``__main__``, is unknown) passes this so the
validators do not refuse it a second time."""


def names_checked(info: ValidationInfo) -> bool:
    """Whether the validation context says the names were checked already (``NAMES_CHECKED``)."""
    return isinstance(info.context, Mapping) and bool(info.context.get("names_checked"))


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    name: str
    value: T
    params: type[BaseModel] | None = None  # None: the value takes no params model (anything goes)
    preflight: Preflight | None = None  # its preflight check, where the registry has them


def is_import_path(ref: str, *, dotted: bool = False) -> bool:
    """``pkg.module:attr`` (the import-path form every loading registry accepts), or with
    ``dotted`` also ``pkg.module.attr``."""
    if " " in ref or "/" in ref:
        return False
    module, sep, attr = ref.partition(":")
    if not sep and dotted:
        module, sep, attr = ref.rpartition(".")
    return bool(sep and module and attr)


def closest(value: str, names: list[str], extra: str = "") -> str:
    """``; did you mean 'x'? (known: a, b, c)`` for an unknown ``value``: the best match, and any
    other about as close (``extra``: other accepted forms, after the names)."""
    scored = sorted(((difflib.SequenceMatcher(None, value, n).ratio(), n) for n in names), reverse=True)
    near = [n for r, n in scored if r >= 0.6 and r >= scored[0][0] - 0.05] if scored else []
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return f"{hint} (known: {', '.join(names)}{'; or ' + extra if extra else ''})"


class Registry(Generic[T]):
    """Name → value (plus its params model). ``kind`` names it in messages (``builder``).

    ``load``: turns an imported object into a ``T`` (and enables ``pkg.module:attr`` names);
    ``coerce``: turns what ``register`` is given into a ``T`` (e.g. a class into an instance);
    ``extra``: words added to the unknown-name message for other accepted forms;
    ``preflight``: True, every entry must bring its own preflight check; a function, the check of
    entries that bring none; False (default), the entries need no host (builders, providers)."""

    def __init__(self, kind: str, *, load: Callable[[Any, str], T] | None = None,
                 coerce: Callable[[Any, str], T] | None = None, extra: str = "", dotted: bool = False,
                 preflight: Preflight | bool = False) -> None:
        self.kind = kind
        self._dotted = dotted
        self._preflight = preflight
        self._entries: dict[str, Entry[T]] = {}
        self._load = load
        self._coerce = coerce
        self._extra = extra

    # -- registering --------------------------------------------------------------------------
    @overload
    def register(self, name: str, value: None = None, *, params: type[BaseModel] | None = None,
                 preflight: Preflight | None = None, replace: bool = False) -> Callable[[V], V]: ...

    @overload
    def register(self, name: str, value: V, *, params: type[BaseModel] | None = None,
                 preflight: Preflight | None = None, replace: bool = False) -> V: ...

    def register(self, name: str, value: Any = None, *, params: type[BaseModel] | None = None,
                 preflight: Preflight | None = None, replace: bool = False) -> Any:
        """Add ``name``; with no ``value``, a decorator. Refuses a taken name unless ``replace``, and,
        in a registry whose entries must bring a preflight check, an entry without one."""
        if preflight is None and self._preflight is True:
            raise ConfigError(f"{self.kind} {name!r} has no preflight check; register it with preflight=<a function "
                              f"that raises ConfigError when this host cannot run the {self.kind}>")
        if preflight is not None and self._preflight is False:
            raise ConfigError(f"{self.kind} {name!r}: {self.kind}s have no preflight checks; register it without one")

        def add(obj: V) -> V:
            if name in self._entries and not replace:
                raise ConfigError(f"{self.kind} {name!r} is already registered (pass replace=True to override)")
            made: T = self._coerce(obj, name) if self._coerce is not None else obj  # type: ignore[assignment]
            self._entries[name] = Entry(name, made, params if params is not None else _params_of(made),
                                        preflight if preflight is not None else self._default_preflight())
            return obj

        return add if value is None else add(value)

    # -- looking up ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[T]:
        return [e.value for e in self._entries.values()]

    def items(self) -> list[tuple[str, T]]:
        return [(n, e.value) for n, e in self._entries.items()]

    def snapshot(self) -> dict[str, Entry[T]]:
        """The entries as they are now (``restore`` puts them back; for tests that register)."""
        return dict(self._entries)

    def restore(self, snapshot: Mapping[str, Entry[T]]) -> None:
        self._entries = dict(snapshot)

    def entry(self, name: str) -> Entry[T]:
        """The entry for ``name`` (or for the import path, when this registry loads them)."""
        found = self._entries.get(name)
        if found is not None:
            return found
        if self._load is not None and is_import_path(name, dotted=self._dotted):
            obj = self._import(name)
            value = self._load(obj, name)
            return Entry(name, value, _params_of(obj) or _params_of(value), self._default_preflight())
        raise self.unknown(name)

    def preflight(self, name: str) -> Preflight:
        """The preflight check of ``name`` (its entry's, else this registry's default); ConfigError
        for an unknown name or a registry without checks."""
        check = self.entry(name).preflight
        if check is None:
            raise ConfigError(f"{self.kind} {name!r} has no preflight check ({self.kind}s need no host)")
        return check

    def _default_preflight(self) -> Preflight | None:
        return None if isinstance(self._preflight, bool) else self._preflight

    def get(self, name: str) -> T:
        return self.entry(name).value

    def __getitem__(self, name: str) -> T:
        return self.entry(name).value

    def unknown(self, name: object) -> ConfigError:
        extra = self._extra or ("a pkg.module:attr import path" if self._load else "")
        return ConfigError(f"unknown {self.kind} {name!r}{closest(str(name), self.names(), extra)}")

    def check(self, name: str, info: ValidationInfo | None = None) -> str:
        """For pydantic validators: ``name`` when it resolves, else ``ValueError`` carrying the one
        line (pydantic adds the field path). Skipped under the ``NAMES_CHECKED`` context."""
        if info is not None and names_checked(info):
            return name
        try:
            self.entry(name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return name

    def check_params(self, name: str, params: Mapping[str, object]) -> BaseModel | None:
        """``params`` validated by ``name``'s params model (None when it has none); one-line ConfigError."""
        model = self.entry(name).params
        if model is None:
            return None
        try:
            return model.model_validate(dict(params))
        except ValidationError as exc:
            raise ConfigError(f"params of {self.kind} {name!r}: {validation_line(exc, model=model)}") from None

    def _import(self, ref: str) -> Any:
        module_name, sep, attr = ref.partition(":")
        if not sep:
            module_name, _, attr = ref.rpartition(".")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot import {self.kind} {ref!r}: {exc}") from None
        return obj


def _params_of(obj: Any) -> type[BaseModel] | None:
    """A value's own params model, when it declares one (``params_model = MyParams``)."""
    model = getattr(obj, "params_model", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def validation_line(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line for a pydantic error: the field path, the problem and the bad value. ``prefix``
    is the path above the model (``engine``); ``model``, the model validated, lets a misspelled
    key get the closest real one. Further problems are counted, not listed."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"]]  # a discriminated union's tag stays in: engine.vllm.seed
    where = ".".join([prefix, *loc] if prefix else loc)
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        fields, owners = _fields_at(model, loc[:-1], loc[-1]) if model is not None and loc else (None, [])
        message = ("not a known setting" + closest(loc[-1], fields)) if fields else \
            "not a known setting (check the spelling, or remove it)"
        if owners:
            message += f"; {loc[-1]!r} is for {owners[0]}"
    elif first["type"] == "missing":
        message = "required, and not given"
    elif first["type"] not in ("value_error", "assertion_error") and "input" in first:
        message = f"{message} (got {_short(first['input'])})"
    more = exc.error_count() - 1
    return f"{where + ': ' if where else ''}{' '.join(message.split())}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _fields_at(model: type[BaseModel], path: list[str], key: str) -> tuple[list[str] | None, list[str]]:
    """The field names of the model found at ``path`` under ``model`` (through nested models,
    optional ones and discriminated unions by ``kind``, whose tag is a path part), and, when the
    last step was such a union, the other members that do have ``key``; (None, []) when lost."""
    current: Any = model
    parts = list(path)
    owners: list[str] = []
    while parts:
        part = parts.pop(0)
        field = current.model_fields.get(part) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return None, []
        members = [a for a in _flat_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        owners = []
        if len(members) > 1 and parts:  # a union by tag: the next part names the member
            tag = parts.pop(0)
            tags = {str(m.model_fields["kind"].default): m for m in members if "kind" in m.model_fields}
            having = sorted(t for t, m in tags.items() if t != tag and key in m.model_fields)
            owners = [f"{part} kind {' or '.join(having)}"] if having else []
            members = [tags[tag]] if tag in tags else []
        if len(members) != 1:
            return None, []
        current = members[0]
    if not (isinstance(current, type) and issubclass(current, BaseModel)):
        return None, []
    # a field named around a keyword or builtin (``json_``) is written without its underscore
    return sorted(name.removesuffix("_") for name in current.model_fields), owners


def _flat_args(annotation: Any) -> list[Any]:
    args = get_args(annotation)
    if not args:
        return [annotation]
    return [leaf for a in args for leaf in _flat_args(a)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
