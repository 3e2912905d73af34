"""YAML configuration files (a build recipe, `rvrun serve --config`) as JSON-like values, for
the artifacts' schema reader (artifacts/schema.At) to check: `parse_yaml` turns the text into
values with every way that can fail (bad syntax, a key given twice, a tag that would build a
Python object) as one SchemaError naming the file and the line; `known_keys` refuses a key the
schema does not have. A shared leaf: the compiler's recipe and the runtime's serve config both
read their files with it.
"""

from __future__ import annotations

from typing import Any

import yaml

from rvcompile.artifacts.schema import At, SchemaError

MAX_BYTES = 1 << 20  # a configuration file is a few hundred bytes; more is not one


class _StrictLoader(yaml.SafeLoader):
    """safe_load (plain data only, no Python objects) that also refuses a key given twice, which
    PyYAML otherwise resolves silently by keeping the last."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, list | dict):
            raise yaml.constructor.ConstructorError(None, None, "a key must be a plain value",
                                                    key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice",
                                                    key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(data: bytes | str, where: str) -> Any:
    """The YAML document in `data` as dicts, lists and scalars; SchemaError
    '<where>: not YAML (... at line L column C)' on any failure."""
    if len(data) > MAX_BYTES:
        raise SchemaError(f"{where}: {len(data)} bytes; a configuration file is at most "
                          f"{MAX_BYTES}")
    try:
        return yaml.load(data, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise SchemaError(f"{where}: not YAML ({e.problem}{at})") from None
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SchemaError(f"{where}: not YAML ({reason})") from None


def known_keys(at: At, allowed: tuple[str, ...]) -> dict[str, Any]:
    """`at`'s mapping, once every key is one of `allowed`; SchemaError 'PATH.KEY: unknown key
    (known: ...)' otherwise. `at.path` "" is the document itself."""
    d = at.obj()
    for key in d:
        if key not in allowed:
            name = key if isinstance(key, str) else repr(key)
            prefix = f"{at.path}." if at.path else ""
            raise SchemaError(f"{prefix}{name}: unknown key (known: {', '.join(allowed)})")
    return d
