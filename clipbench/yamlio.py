"""The one YAML reader of the project: recipes, sweep files, command-line values, a run's config.yaml.

    data = load_yaml_file("recipes/quickstart.yaml")    # bytes -> UTF-8 text -> mapping
    value = load_yaml_text("[1, 2]", source="command line")

Design choices:
- PyYAML's safe loader, with two changes: a mapping that repeats a key is an error naming the line
  of the repeat, the key and the line of its first occurrence (PyYAML silently keeps the last,
  so a recipe with two `lr:` lines trains with whichever came last), while the keys a merge key
  (`<<: *base`) brings in may be overridden by the mapping's own (YAML's merge-then-override idiom);
  and aliases that expand a document by more than MAX_ALIASED values are refused before anything
  walks it (a 548-byte "billion laughs" took minutes and gigabytes).
- Files are read as bytes and decoded as UTF-8 here, so a file in another encoding (or a binary
  file passed by mistake) is one clear error, not a UnicodeDecodeError from deep inside.
- Every problem is a `YamlError(reason, line)`; callers turn it into their own one-line error
  (`ConfigError` for recipes and sweeps, `StoreError` for the results store).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class YamlError(ValueError):
    """A YAML text that cannot be read: ``reason`` and, when known, the 1-based ``line``."""

    def __init__(self, reason: str, line: int | None = None):
        self.reason, self.line = reason, line
        super().__init__(f"line {line}: {reason}" if line else reason)


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser: 7x faster
    """The safe loader, refusing repeated keys in a mapping."""


MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:  # the mapping's own keys: a merge key's (<<) may be overridden by them
        if key_node.tag == MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise YamlError(f"a mapping key must be a plain value, got {key!r}", key_node.start_mark.line + 1) from None
        line = key_node.start_mark.line + 1
        if key in first:
            raise YamlError(f"duplicate key '{key}' (first at line {first[key]}); remove one of them", line)
        first[key] = line
    loader.flatten_mapping(node)  # merge keys (<<): the merged mappings' keys first, the own keys after them win
    return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# Values that aliases (*name) may add to a document beyond those written in it. Aliases share what
# they name, so a 548-byte text can stand for 10^9 values ("billion laughs"); whatever walks it then
# takes minutes and gigabytes. A recipe or a sweep file repeats a few sections at most.
MAX_ALIASED = 100_000


def _check_aliases(root: yaml.Node) -> None:
    """YamlError when the document's aliases expand it by more than MAX_ALIASED values, or name a
    node inside itself (a recursive alias); counted on the node graph, shared nodes once each."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise YamlError("an alias names a node that contains it (a recursive alias)", node.start_mark.line + 1)
        open_.add(key)
        if isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        else:
            n = 1
        open_.discard(key)
        sizes[key] = n
        return n

    total = size(root)
    if total - len(sizes) > MAX_ALIASED:
        raise YamlError(
            f"its aliases (*name) expand it to {total:,} values from the {len(sizes):,} written: more than "
            f"{MAX_ALIASED:,} added, refused (a YAML 'billion laughs'); write the values out or repeat fewer"
        )


def load_yaml_text(text: str) -> Any:
    """Parse YAML text (any top-level type). Raises YamlError (syntax, duplicate keys, aliases that
    expand it beyond MAX_ALIASED values). Merge keys (`<<: *base`) merge, and the mapping's own keys
    override what they merge."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_aliases(node)
        return loader.construct_document(node)
    except YamlError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise YamlError(f"YAML syntax error: {problem}", mark.line + 1 if mark is not None else None) from None
    finally:
        loader.dispose()


def decode_utf8(data: bytes) -> str:
    """UTF-8 text of a file's bytes (a leading BOM is dropped). Raises YamlError when not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise YamlError(
            f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save the file as UTF-8", line
        ) from None


def load_yaml_file(path: str | Path) -> Any:
    """Read a YAML file: bytes, UTF-8, then `load_yaml_text`. OSError (missing file ...) propagates."""
    return load_yaml_text(decode_utf8(Path(path).read_bytes()))


def dump_yaml(data: Any) -> str:
    """Block-style YAML in the mapping's own key order (what the store and recipes are written as)."""
    return yaml.safe_dump(data, sort_keys=False)


def flatten(d: Mapping, prefix: str = "", *, sections: bool = False) -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists kept as values); `sections=True` keeps every mapping under
    its own key too: {'a': {'b': 1}, 'a.b': 1} (a dataset row reachable both ways)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            if sections:
                out[key] = v
            out.update(flatten(v, key + ".", sections=sections))
        else:
            out[key] = v
    return out
