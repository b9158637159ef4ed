"""Build a RunConfig from a recipe (YAML) plus `--set a.b=c` overrides.

Errors name the offending key and say how to fix it; nothing is silently ignored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agentrl.config.schema import RunConfig

RECIPES_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(ValueError):
    """A config problem, with a message naming the key and the fix."""


def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe by name (configs/NAME.yaml) or by path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file {p} " + ("is a folder; pass a YAML file" if p.is_dir() else "not found"))
        return p
    cand = RECIPES_DIR / f"{name_or_path}.yaml"
    if not cand.is_file():
        known = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.yaml")))
        raise ConfigError(f"unknown recipe {str(name_or_path)!r}; known recipes: {known} (or pass a YAML path)")
    return cand


def list_recipes() -> list[str]:
    return sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {yaml_error_line(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if data is None:
        raise ConfigError(f"{path}: the recipe is empty; it needs at least `recipe: NAME` and the sections it sets")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def yaml_error_line(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: where (1-based line and column) and what."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else " ".join(str(e).split())


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.max_steps=3)")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {item!r}: empty key part; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_override(tree: dict[str, Any], parts: list[str], value: Any, raw: str | None = None) -> None:
    """Set tree[parts...] = value, checking every key exists in the schema (so typos fail here).

    `raw` is the text the user typed; string-typed fields keep it verbatim ("1" stays "1")."""
    model: Any = RunConfig
    node = tree
    for i, part in enumerate(parts):
        dotted = ".".join(parts[: i + 1])
        fields = getattr(model, "model_fields", None)
        if fields is None:
            # Below a dict-typed field (e.g. sglang.env): free-form keys, string values.
            if i == len(parts) - 1:
                node[part] = raw if raw is not None and model is str else value
            else:
                node = node.setdefault(part, {})
            continue
        if part not in fields:
            near = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key {dotted!r}; keys at this level: {near}")
        if i == len(parts) - 1:
            annotation = fields[part].annotation
            keep_text = raw is not None and value is not None and annotation in (str, str | None)
            node[part] = raw if keep_text else value
            return
        annotation = fields[part].annotation
        sub = annotation if isinstance(annotation, type) and hasattr(annotation, "model_fields") else None
        if sub is None and not _is_dict_type(annotation):
            raise ConfigError(f"config key {dotted!r} is a value, not a section; write {dotted}=VALUE")
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
        model = sub if sub is not None else _dict_value_type(annotation)


def _is_dict_type(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict


def _dict_value_type(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", ())
    return args[1] if len(args) == 2 else object


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not key or e["type"] == "value_error" and isinstance(e.get("input"), dict):
            # A check across fields (a model validator): its message names the fields itself.
            lines.append(f"  {msg}")
            continue
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or check its spelling (see `agentrl config show`)")
        else:
            got = e.get("input")
            shown = repr(got) if not isinstance(got, dict) else "a mapping"
            lines.append(f"  {key}: {msg} (got {shown}); fix it in the recipe or with --set {key}=...")
    return "\n".join(lines)


def load_config(
    recipe: str | Path | None = "local",
    overrides: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> RunConfig:
    """Recipe (name or YAML path) -> `extra` (launcher options, a nested dict) -> `--set` overrides."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if recipe is not None:
        path = recipe_path(recipe)
        tree = read_yaml(path)
        tree.setdefault("recipe", path.stem)
        source = str(path)
    tree = copy.deepcopy(tree)
    for dotted, value in _flatten(extra or {}):
        apply_override(tree, dotted, value)
    for item in overrides or []:
        parts, value = parse_override(item)
        apply_override(tree, parts, value, raw=item.split("=", 1)[1])
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source + (" + overrides" if overrides else ""))) from None


def _flatten(d: dict[str, Any], prefix: list[str] | None = None):
    prefix = prefix or []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flatten(v, prefix + [k])
        else:
            yield prefix + [k], v
