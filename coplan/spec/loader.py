"""Load specs from YAML or JSON files, preset names or dicts, with one readable error per file.

Every failure becomes a :class:`~coplan.errors.SpecError` that names the file, the field path and
the reason; an unknown key comes with the nearest valid key. Nothing else escapes.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import os
import re
import stat
import tempfile
import typing
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml
from pydantic import BaseModel, ValidationError

from coplan.errors import AmbiguousNameError, CoplanError, PresetNotFoundError, SpecError
from coplan.spec.base import FROM_FILE
from coplan.spec.calibration import Calibration
from coplan.spec.plan import Plan
from coplan.spec.run import RunResult
from coplan.spec.topology import Topology
from coplan.spec.workload import Workload

M = TypeVar("M", bound=BaseModel)

PRESET_PACKAGES = {Topology: "coplan.topologies", Workload: "coplan.workloads"}


def list_presets(kind: type[BaseModel]) -> list[str]:
    pkg = PRESET_PACKAGES.get(kind)
    if pkg is None:
        return []
    return sorted(p.name[:-5] for p in resources.files(pkg).iterdir() if p.name.endswith(".yaml"))


def preset_path(kind: type[BaseModel], name: str) -> Path:
    return Path(str(resources.files(PRESET_PACKAGES[kind]).joinpath(f"{name}.yaml")))


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that gives one key twice (PyYAML and ``json`` keep the last value without a word)."""

    def __init__(self, key: Any, where: str, path: str = "") -> None:
        self.key, self.where, self.path = key, where, path
        super().__init__(f"duplicate key {key!r} {where}")

    def reason(self, fmt: str) -> str:
        return (f"duplicate key {str(self.key)!r} {self.where}: {fmt} keys must be unique and the reader would keep "
                "only the last value; remove one of them")


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that resolves plain scalars by YAML 1.2's core schema, as JSON does, not PyYAML's YAML 1.1:
    only ``true``/``false`` are booleans (``off``, ``on``, ``yes``, ``no`` stay strings, so ``cuda_graphs: off``
    means ``'off'`` and a task named ``on`` is not True); ``1e12`` is a float (1.1 wants a dot and a signed
    exponent); integers are decimal, ``0x`` or ``0o`` (``6_4`` and ``1:30`` are strings, ``010`` is 10); no
    timestamps. It also refuses a mapping that repeats a key (YAML 1.2 says keys are unique; PyYAML keeps the
    last silently)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            # explicit keys only: a key merged in with '<<' may be overridden, as YAML's merge says
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base constructor says so
                    break
                if seen is not key_node:
                    raise DuplicateKeyError(key, f"at line {key_node.start_mark.line + 1} (first given at line "
                                                 f"{seen.start_mark.line + 1})")
        return super().construct_mapping(node, deep=deep)


class _Yaml12Dumper(yaml.SafeDumper):
    """Dumper that quotes strings the loader above would read as floats (e.g. a name '1e5')."""


_FLOAT_RE = re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)

# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution)
_BOOL12_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT12_RE = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT12_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_KEEP_11 = ("tag:yaml.org,2002:null", "tag:yaml.org,2002:merge")  # the same in 1.2 (merge: PyYAML's '<<')

_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag in _KEEP_11]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL12_RE, list("tTfF"))
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT12_RE, list("-+0123456789"))
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT12_RE, list("-+0123456789."))


def _construct_int12(loader: _Yaml12Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)  # PyYAML's own reads 010 as octal 8, as YAML 1.1 does
    return int(text[2:], 16 if text[1] == "x" else 8) if text[:2] in ("0x", "0o") else int(text, 10)


_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int12)

# The dumper keeps YAML 1.1's resolvers and adds the loader's: a string either reader would take for
# something else ('off', '1e5', '0o17', '-.5') is written quoted, for this loader and for any other.
for _rx in (_FLOAT_RE, _FLOAT12_RE):
    _Yaml12Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _rx, list("-+0123456789."))
_Yaml12Dumper.add_implicit_resolver("tag:yaml.org,2002:int", _INT12_RE, list("-+0123456789"))


_YAML_BREAKS = ("\x85", "\u2028", "\u2029")


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # YAML counts NEL, LS and PS as line breaks: in a plain or single-quoted scalar they are folded
    # on reading ('0\x850' came back as '0 0'); the double-quoted style writes them as escapes.
    if any(c in value for c in _YAML_BREAKS):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    return dumper.represent_str(value)


_Yaml12Dumper.add_representer(str, _represent_str)


def yaml_dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Yaml12Dumper, sort_keys=False, allow_unicode=True)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


MAX_FILE_BYTES = 256 << 20
"""Largest file coplan reads as a spec (a plan of 100,000 tables is ~50 MB of JSON)."""

MAX_VALUES = 10_000_000
"""Most values (mappings, lists and scalars, YAML aliases counted at every use) one document may hold:
far above any real spec, and low enough that an alias bomb is refused before it is validated."""


class _Pairs(list):
    """A JSON object as read, key-value pairs in order, before duplicates are checked."""


def _path_str(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


class _CycleError(ValueError):
    """A YAML alias used inside its own anchor: the document holds itself (``a: &x {b: *x}``)."""

    def __init__(self, path: tuple, back_to: tuple) -> None:
        self.path = _path_str(path)
        where = f"'{_path_str(back_to)}'" if back_to else "the document's root"
        self.reason = (f"refers back to {where}, which holds it (a YAML alias used inside its own anchor): specs "
                       "cannot be cyclic; write the value out, or alias a part that does not hold the alias")
        super().__init__(f"{self.path}: {self.reason}")


def _settle(doc: Any) -> Any:
    """JSON objects made dicts with duplicate keys refused by field path; a document that holds itself (a YAML
    alias inside its own anchor) refused where it does; and a bound on the values a document expands to (YAML
    aliases share one object that validation would walk at every use)."""
    root = [doc]
    # (container, slot, path) of each mapping or list still to visit; None marks leaving the last one entered
    stack: list[tuple[Any, Any, tuple] | None] = [(root, 0, ())] if isinstance(doc, (dict, list)) else []
    on_path: dict[int, tuple] = {}  # id() of each container from the root down to the one visited -> its path
    entered: list[int] = []
    count = 0
    while stack:
        item = stack.pop()
        if item is None:
            del on_path[entered.pop()]
            continue
        parent, slot, path = item
        node = parent[slot]
        if id(node) in on_path:
            raise _CycleError(path, on_path[id(node)])
        if isinstance(node, _Pairs):
            out: dict[Any, Any] = {}
            for k, v in node:
                if k in out:
                    raise DuplicateKeyError(k, "given twice in one object", _path_str(path + (k,)))
                out[k] = v
            parent[slot] = node = out
        on_path[id(node)] = path
        entered.append(id(node))
        stack.append(None)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            count += 1
            if isinstance(v, (dict, list)):
                stack.append((node, k, path + (k,)))
        if count > MAX_VALUES:
            raise ValueError(f"holds more than {MAX_VALUES:,} values (YAML aliases count at every use); no spec is "
                             "this large")
    return root[0]


def _parse_text(text: str, source: str) -> Any:
    """Parse YAML, or JSON for a ``.json`` source, as one SpecError naming ``source`` on any failure."""
    is_json = source.endswith(".json")
    try:
        if is_json:
            return _settle(json.loads(text, object_pairs_hook=_Pairs))
        return _settle(yaml_load(text))
    except DuplicateKeyError as e:
        raise SpecError(source, [(e.path, e.reason("JSON" if is_json else "YAML"))]) from None
    except _CycleError as e:
        raise SpecError(source, [(e.path, e.reason)]) from None
    except json.JSONDecodeError as e:
        raise SpecError(source, [("", f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(source, [("", f"not valid YAML: {problem}{where}")]) from None
    except RecursionError:
        raise SpecError(source, [("", "nested too deeply to be a spec")]) from None
    except (ValueError, OverflowError, MemoryError) as e:
        raise SpecError(source, [("", f"cannot be parsed: {e}")]) from None


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read or replaced as a regular file, following symbolic links: it is a directory, a
    device, a FIFO or a socket (reading a FIFO waits for a writer forever; replacing ``/dev/null`` as root
    makes it a file), or a symbolic link loop; None for a regular file or nothing there. The caller adds the fix."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop (it resolves to itself)"
        return None  # unreadable: the caller's own read or write says why
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISREG(mode):
        return None
    what = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return f"is {what}, not a regular file"


def read_text(path: str | Path, source: str | None = None) -> str:
    """The UTF-8 text of a file a user named, or a SpecError naming it: missing, empty path, a directory or
    other non-regular file (checked before opening: a FIFO would block), too large, binary (NUL bytes) or
    not UTF-8. For every reader of user files, specs or not."""
    if not str(path).strip():
        raise SpecError(repr(str(path)), [("", "the path is empty; give the path of a file")])
    p = Path(path)
    source = source or str(path)
    why = not_a_file(p)
    if why:
        raise SpecError(source, [("", f"{why}; give the path of a file")])
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise SpecError(source, [("", f"is {size / 2**20:,.0f} MiB, over the {MAX_FILE_BYTES >> 20} MiB coplan "
                                          "reads as one file; is this the right file?")])
        raw = p.read_bytes()
    except FileNotFoundError:
        if p.is_symlink():
            raise SpecError(source, [("", f"is a symbolic link to '{os.readlink(p)}', which does not exist")]) from None
        raise SpecError(source, [("", "no such file")]) from None
    except OSError as e:
        raise SpecError(source, [("", f"cannot be read: {e.strerror or e}")]) from None
    if b"\x00" in raw:
        at = raw.index(b"\x00")
        raise SpecError(source, [("", f"is a binary file (a NUL byte at offset {at:,}), not YAML or JSON text; "
                                      "is this the right file?")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise SpecError(source, [("", f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, offset {e.start:,}); "
                                      "coplan reads YAML or JSON saved as UTF-8: is this the right file?")]) from None
    return text[1:] if text.startswith("\ufeff") else text


def load_document(path: str | Path, source: str | None = None) -> Any:
    """A YAML or JSON file (JSON when the name ends in ``.json``) parsed, with duplicate keys refused and
    every failure a SpecError naming the file: for readers of user files that are not specs (sweeps,
    summaries), so they fail as the spec loader does."""
    return _parse_text(read_text(path, source), str(path) if source is None else source)


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes an annotation may hold (through Optional, Union, tuple, dict, Annotated)."""
    out: list[Any] = []
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (Union, getattr(__import__("types"), "UnionType", None)):
        for a in typing.get_args(annotation):
            out.extend(_unwrap(a))
        return out
    if origin in (tuple, list):
        for a in typing.get_args(annotation):
            if a is not Ellipsis:
                out.extend(_unwrap(a))
        return out
    if origin is dict:
        args = typing.get_args(annotation)
        return _unwrap(args[1]) if len(args) == 2 else []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return out


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that owns the last element of ``loc`` (best effort, for suggestions)."""
    current: list[type[BaseModel]] = [root]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        nxt: list[type[BaseModel]] = []
        for m in current:
            field = m.model_fields.get(part)
            if field is not None:
                nxt.extend(_unwrap(field.annotation))
            else:
                # discriminated-union tags appear in loc as the tag value: keep the matching member
                for cand in current:
                    tag = cand.model_fields.get("type") or cand.model_fields.get("kind")
                    if tag is not None and tag.default == part:
                        nxt.append(cand)
        if nxt:
            current = nxt
    return current[0] if len(current) == 1 else (current[0] if current else None)


def _strip_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop discriminator tags (pydantic inserts them after a list index) so paths match the file."""
    out = []
    for i, p in enumerate(loc):
        if isinstance(p, str) and i > 0 and (isinstance(loc[i - 1], int) or loc[i - 1] == "length") and _is_tag(p):
            continue
        out.append(p)
    return tuple(out)


_UNION_MEMBER = re.compile(r"[a-z]+(?:-[a-z]+)*\[.*\]|int|float|str|bool|none|bytes", re.S)
"""How pydantic labels the member of a union an error came from, in the error's location: its schema's name
(``function-after[...]``, ``literal['auto']``, ``int``); never a field name, which has no brackets."""


def _strip_union_members(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """``loc`` without the union-member labels pydantic inserts (they name its internals, not the file)."""
    return tuple(p for i, p in enumerate(loc) if not (i and isinstance(p, str) and _UNION_MEMBER.fullmatch(p)))


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


_TAGS: set[str] | None = None


def _is_tag(value: str) -> bool:
    global _TAGS
    if _TAGS is None:
        from coplan.spec import workload as w

        _TAGS = set()
        for obj in vars(w).values():
            if isinstance(obj, type) and issubclass(obj, BaseModel):
                for key in ("type", "kind"):
                    f = obj.model_fields.get(key)
                    if f is not None and isinstance(f.default, str):
                        _TAGS.add(f.default)
    return value in _TAGS


def _reason(err: dict[str, Any], root: type[BaseModel]) -> str:
    etype = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    if etype == "extra_forbidden" and loc:
        owner = _model_at(root, loc)
        key = str(loc[-1])
        if owner is not None:
            valid = list(owner.model_fields)
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
            return f"unknown key '{key}'{hint}"
        return f"unknown key '{key}'"
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if etype in ("missing",):
        return "required field is missing"
    inp = err.get("input")
    if etype in ("float_type", "int_type") and isinstance(inp, str):
        if "_" in inp and _FLOAT12_RE.match(inp.replace("_", "")):
            msg += f"; coplan reads YAML 1.2, where digits grouped with '_' are a string: write {inp.replace('_', '')}"
        else:
            msg += "; a quoted value is a string: write the number without quotes"
    if etype == "bool_type" and isinstance(inp, str) and inp.lower() in ("yes", "no", "on", "off", "y", "n"):
        msg += "; coplan reads YAML 1.2, where yes/no/on/off are strings: write true or false"
    if etype not in ("missing",) and not isinstance(inp, (dict, list)) and inp is not None:
        shown = repr(inp)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return f"{msg} (got {shown})"
    return msg


_FIELD_MSG = re.compile(r"^@([^@]+)@ (.*)$", re.S)


def _union_reason(errs: list[dict[str, Any]]) -> str:
    """One reason for a value no member of a union took (``PosInt | Literal['auto']``): each member's complaint,
    the literals it could have been last, and the value once."""
    literals = [str(e.get("ctx", {}).get("expected")) for e in errs if e.get("type") == "literal_error"]
    others = list(dict.fromkeys(str(e.get("msg", "invalid")).removeprefix("Value error, ")
                                for e in errs if e.get("type") != "literal_error"))
    msg = "; or ".join(others + ([f"give {' or '.join(literals)}"] if literals else []))
    inp = errs[0].get("input")
    if isinstance(inp, (dict, list)) or inp is None:
        return msg
    shown = repr(inp)
    return f"{msg} (got {shown if len(shown) <= 60 else shown[:57] + '...'})"


def validation_issues(exc: ValidationError, root: type[BaseModel]) -> list[tuple[str, str]]:
    errors = exc.errors()
    locs = [tuple(e.get("loc", ())) for e in errors]
    # A value no member of a union took: one error per member, each under the member's label; one issue here.
    unions: dict[tuple, list[dict[str, Any]]] = {}
    for err, loc in zip(errors, locs):
        bare = _strip_union_members(loc)
        if bare != loc:
            unions.setdefault(bare, []).append(err)
    issues: list[tuple[str, str]] = []
    for err, loc in zip(errors, locs):
        # A "too short" on a list whose items themselves failed is noise: the item errors say why.
        if err.get("type") == "too_short" and any(len(o) > len(loc) and o[: len(loc)] == loc for o in locs):
            continue
        bare = _strip_union_members(loc)
        members = unions.get(bare) if bare != loc else None
        if members is not None and len(members) > 1:
            if err is not members[0]:
                continue
            reason = _union_reason(members)
        else:
            reason = _reason(err, root)
        path = _format_loc(_strip_tags(bare))
        m = _FIELD_MSG.match(reason)
        if m:  # a model validator named the field it is about
            sub, reason = m.group(1), m.group(2)
            path = f"{path}.{sub}" if path and not sub.startswith("[") else f"{path}{sub}"
        issues.append((path, reason))
    return issues


def parse_spec(kind: type[M], data: Any, source: str) -> M:
    """Validate already-parsed data as ``kind``; all failures become a SpecError naming ``source``."""
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise SpecError(source, [("", f"expected a mapping of {kind.__name__} fields, got {got}")])
    try:
        return kind.model_validate(data, context={FROM_FILE: True})
    except ValidationError as e:
        raise SpecError(source, validation_issues(e, kind)) from None
    except RecursionError:
        raise SpecError(source, [("", "nested too deeply")]) from None


SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def looks_like_path(arg: str) -> bool:
    """Whether an argument names a file, never a preset: it has a path separator or a spec suffix."""
    return "/" in arg or os.sep in arg or bool(os.altsep and os.altsep in arg) or Path(arg).suffix.lower() in SPEC_SUFFIXES


def resolve(kind: type[BaseModel], name_or_path: str | Path) -> Path:
    """Where a ``kind`` spec given by name or path is read from; presets and files never shadow each other.

    An argument with a path separator or a ``.yaml``/``.yml``/``.json`` suffix is a path and only a path.
    A bare name is a preset; a bare name that is also a file in the current directory is refused (which
    was meant?) with how to ask for each; a bare name that is only a file is that file.
    """
    arg = str(name_or_path)
    p = Path(arg)
    presets = list_presets(kind)
    what = kind.__name__.lower()
    if not arg.strip():  # Path('') is the current folder
        hint = f"a {what} preset name or " if presets else ""
        raise PresetNotFoundError(f"the {what} path is empty; give {hint}the path of a {what} file")
    if looks_like_path(arg):
        if p.exists() or p.is_symlink():  # a broken link or a loop: read_text says which
            return p
        stem = p.stem if p.suffix.lower() in SPEC_SUFFIXES else p.name
        hint = f" ('{stem}' is a {what} preset: give the bare name '{stem}' to use it.)" if stem in presets else ""
        raise PresetNotFoundError(f"{arg}: no such file.{hint}")
    if arg in presets:
        if p.exists():
            raise AmbiguousNameError(
                f"'{arg}' is both a {what} preset and a file in the current directory; say which: './{arg}' for the "
                f"file, or the preset's path {preset_path(kind, arg)} (or rename the file)"
            )
        return preset_path(kind, arg)
    if p.exists() or p.is_symlink():
        return p
    near = difflib.get_close_matches(arg, presets, n=1, cutoff=0.5)
    hint = f" Did you mean '{near[0]}'?" if near else ""
    files = [f"./{arg}{suf}" for suf in SPEC_SUFFIXES if Path(arg + suf).is_file()]
    if files:
        hint += f" The file {files[0]} exists: give its name with the suffix."
    listed = f" Presets: {', '.join(presets)}." if presets else ""
    raise PresetNotFoundError(f"{arg}: no such file, and not a {what} preset.{hint}{listed}")


def _source(kind: type[BaseModel], name_or_path: str | Path, path: Path) -> str:
    """How errors name what was loaded: the argument as given, or the preset with its file."""
    arg = str(name_or_path)
    if not looks_like_path(arg) and arg in list_presets(kind) and path == preset_path(kind, arg):
        return f"{path} (preset '{arg}')"
    return arg


_KIND_WORDS: dict[type[BaseModel], tuple[str, str]] = {
    # kind -> (what it is called, what to give instead)
    Topology: ("topology", "a topology file or preset (topologies/)"),
    Workload: ("workload", "a workload file or preset (workloads/)"),
    Plan: ("plan", "a plan.json written by `coplan plan`"),
    Calibration: ("calibration", "a calibration.json written by `coplan calibrate`"),
    RunResult: ("run summary", "a run's summary.json written by `coplan train`"),
}


def wrong_kind(wanted: type[BaseModel], found: type[BaseModel]) -> str:
    """The reason given for a file of kind ``found`` where a ``wanted`` was asked for."""
    a, b = _KIND_WORDS[found][0], _KIND_WORDS[wanted][0]
    fix = ("did you swap the topology and the workload (-t and -w)?" if {wanted, found} == {Topology, Workload}
           else f"give {_KIND_WORDS[wanted][1]}")
    return f"looks like a{'n' if a[0] in 'aeiou' else ''} {a}, given as the {b}; {fix}"


def load_spec(kind: type[M], name_or_path: str | Path) -> M:
    """Load a ``kind`` spec from a preset name or a YAML/JSON path (see :func:`resolve`). A file that fails
    as ``kind`` but looks like another spec (a workload given as the topology) says so, not its keys one by one."""
    path = resolve(kind, name_or_path)
    source = _source(kind, name_or_path, path)
    data = _parse_text(read_text(path, source), str(path))
    try:
        return parse_spec(kind, data, source)
    except SpecError:
        found = sniff_kind(data)
        if found is not None and found is not kind:
            raise SpecError(source, [("", wrong_kind(kind, found))]) from None
        raise


def load_topology(name_or_path: str | Path) -> Topology:
    return load_spec(Topology, name_or_path)


def load_workload(name_or_path: str | Path) -> Workload:
    return load_spec(Workload, name_or_path)


def load_plan(path: str | Path) -> Plan:
    return load_spec(Plan, path)


def load_calibration(path: str | Path) -> Calibration:
    return load_spec(Calibration, path)


def load_run_result(path: str | Path) -> RunResult:
    return load_spec(RunResult, path)


_UMASK = os.umask(0)
os.umask(_UMASK)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file of the same folder, then
    renamed over ``path`` (a failed write leaves neither a half-written file nor the temporary one).

    A symbolic link is written through: the file it points to is replaced and the link kept, as a plain
    write would. A path that is not a regular file (a folder, a device such as ``/dev/null``, a FIFO, a
    socket, a link loop) is refused with a CoplanError, never replaced; a failed write raises the OSError
    with ``path`` as given, not the temporary file, as its file name."""
    path = Path(path)
    why = not_a_file(path)
    if why:
        raise CoplanError(f"{path}: {why}: coplan writes only regular files and will not replace it; give a file name")
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_UMASK)  # as a plain write would
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    return path


def dump_spec(model: BaseModel, path: str | Path) -> Path:
    """Write a spec as JSON (``.json``) or YAML (anything else), whole or not at all."""
    path = Path(path)
    data = model.model_dump(mode="json")
    return write_text_atomic(path, json.dumps(data, indent=1) + "\n" if path.suffix == ".json" else yaml_dump(data))


SPEC_KINDS: dict[str, type[BaseModel]] = {
    "topology": Topology,
    "workload": Workload,
    "plan": Plan,
    "calibration": Calibration,
    "run": RunResult,
}


def sniff_kind(data: Any) -> type[BaseModel] | None:
    """Guess which spec a parsed document is, from its keys: each kind's own required key first (a run
    summary also holds ``world_size`` and ``device``, a plan ``topology`` and ``workload``)."""
    if not isinstance(data, dict):
        return None
    keys = set(data)
    if "run_id" in keys:
        return RunResult
    if {"mesh", "world_size"} & keys:
        return Plan
    if {"gpu", "tiers"} & keys:
        return Topology
    if {"blocks", "batch"} & keys:
        return Workload
    if {"op_classes", "collective_efficiency", "device"} & keys:
        return Calibration
    return None


def load_any(path: str | Path) -> BaseModel:
    """Load a file of any spec kind, guessed from its keys (for ``coplan validate``); a bare preset name
    is a topology or workload preset, as :func:`resolve` has it."""
    arg = str(path)
    if not looks_like_path(arg):
        for kind in (Topology, Workload):
            if arg in list_presets(kind):
                return load_spec(kind, arg)
    p = Path(arg)
    if not arg.strip():
        raise PresetNotFoundError("the path is empty; give the path of a spec file, or a preset name")
    if not p.exists() and not p.is_symlink():  # a broken link or a loop: read_text says which
        raise PresetNotFoundError(f"{arg}: no such file, and not a topology or workload preset")
    data = _parse_text(read_text(p, arg), arg)
    kind = sniff_kind(data)
    if kind is None:
        raise SpecError(arg, [("", "cannot tell which spec this is (expected topology, workload, plan, calibration or run keys)")])
    return parse_spec(kind, data, arg)
