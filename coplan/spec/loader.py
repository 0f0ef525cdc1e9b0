"""Load specs from YAML or JSON files, preset names or dicts, with one readable error per file.

Every failure becomes a :class:`~coplan.errors.SpecError` that names the file, the field path and
the reason; an unknown key comes with the nearest valid key. Nothing else escapes.
"""

from __future__ import annotations

import difflib
import re
import json
import typing
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml
from pydantic import BaseModel, ValidationError

from coplan.errors import PresetNotFoundError, SpecError
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


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e12`` and ``4.8e12`` as floats, as YAML 1.2 and JSON do (PyYAML's
    YAML 1.1 resolver wants a dot and a signed exponent and would read them as strings)."""


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
for _cls in (_Yaml12Loader, _Yaml12Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


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


def _parse_text(text: str, source: str) -> Any:
    try:
        if source.endswith(".json"):
            return json.loads(text)
        return yaml_load(text)
    except json.JSONDecodeError as e:
        raise SpecError(source, [("", f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(source, [("", f"not valid YAML: {problem}{where}")]) from None
    except (RecursionError, ValueError, OverflowError) as e:
        raise SpecError(source, [("", f"cannot be parsed: {type(e).__name__}: {e}")]) from None


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
    if etype not in ("missing",) and not isinstance(inp, (dict, list)) and inp is not None:
        shown = repr(inp)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return f"{msg} (got {shown})"
    return msg


_FIELD_MSG = re.compile(r"^@([^@]+)@ (.*)$", re.S)


def validation_issues(exc: ValidationError, root: type[BaseModel]) -> list[tuple[str, str]]:
    errors = exc.errors()
    issues: list[tuple[str, str]] = []
    locs = [tuple(e.get("loc", ())) for e in errors]
    for err, loc in zip(errors, locs):
        # A "too short" on a list whose items themselves failed is noise: the item errors say why.
        if err.get("type") == "too_short" and any(len(o) > len(loc) and o[: len(loc)] == loc for o in locs):
            continue
        reason = _reason(err, root)
        path = _format_loc(_strip_tags(loc))
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
        return kind.model_validate(data)
    except ValidationError as e:
        raise SpecError(source, validation_issues(e, kind)) from None
    except RecursionError:
        raise SpecError(source, [("", "nested too deeply")]) from None


def resolve(kind: type[BaseModel], name_or_path: str | Path) -> Path:
    """A path as given when it exists; else a preset of that name; else a clear error."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = str(name_or_path)
    presets = list_presets(kind)
    stem = p.stem if p.suffix in (".yaml", ".yml", ".json") else name
    if stem in presets and (p.parent == Path(".") or not p.exists()):
        if p.suffix and p.parent != Path("."):
            pass
        return preset_path(kind, stem)
    near = difflib.get_close_matches(stem, presets, n=1, cutoff=0.5)
    hint = f" Did you mean '{near[0]}'?" if near else ""
    listed = f" Presets: {', '.join(presets)}." if presets else ""
    raise PresetNotFoundError(f"{name}: no such file, and not a {kind.__name__.lower()} preset.{hint}{listed}")


def load_spec(kind: type[M], name_or_path: str | Path) -> M:
    path = resolve(kind, name_or_path)
    source = str(name_or_path) if Path(name_or_path).is_file() else f"{path} (preset '{Path(path).stem}')"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(str(name_or_path), [("", f"cannot be read: {e}")]) from None
    return parse_spec(kind, _parse_text(text, str(path)), source)


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


def dump_spec(model: BaseModel, path: str | Path) -> Path:
    """Write a spec as JSON (``.json``) or YAML (anything else)."""
    path = Path(path)
    data = model.model_dump(mode="json")
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    else:
        path.write_text(yaml_dump(data), encoding="utf-8")
    return path


SPEC_KINDS: dict[str, type[BaseModel]] = {
    "topology": Topology,
    "workload": Workload,
    "plan": Plan,
    "calibration": Calibration,
    "run": RunResult,
}


def sniff_kind(data: Any) -> type[BaseModel] | None:
    """Guess which spec a parsed document is, from its keys."""
    if not isinstance(data, dict):
        return None
    keys = set(data)
    if {"mesh", "world_size"} & keys:
        return Plan
    if {"gpu", "tiers"} & keys:
        return Topology
    if {"blocks", "batch"} & keys:
        return Workload
    if {"op_classes", "collective_efficiency", "device"} & keys and "run_id" not in keys:
        return Calibration
    if "run_id" in keys:
        return RunResult
    return None


def load_any(path: str | Path) -> BaseModel:
    """Load a file of any spec kind, guessed from its keys (for ``coplan validate``)."""
    p = Path(path)
    for kind in (Topology, Workload):
        if not p.is_file() and str(path) in list_presets(kind):
            return load_spec(kind, path)
    if not p.is_file():
        raise PresetNotFoundError(f"{path}: no such file, and not a topology or workload preset")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(str(path), [("", f"cannot be read: {e}")]) from None
    data = _parse_text(text, str(p))
    kind = sniff_kind(data)
    if kind is None:
        raise SpecError(str(path), [("", "cannot tell which spec this is (expected topology, workload, plan, calibration or run keys)")])
    return parse_spec(kind, data, str(path))
