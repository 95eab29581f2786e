"""The results store's format version: every manifest.json and every run's status.json records it
(`store_format`). A file without one is format 1, what clipbench 0.1.0 wrote.

    data = read_format(path, json_dict)   # a file of an older format, migrated to today's in memory;
                                          # a newer or unknown one: StoreError (one line), nothing read
    STORE_FORMAT                          # what this release writes

Formats:
  1  clipbench 0.1.0: no `store_format` field.
  2  format 1 plus `store_format: 2` in manifest.json and status.json; nothing else changed, so the
     migration from 1 only records the version (tests/fixtures/store_format1 holds a store 0.1.0 wrote).

A change to what a store file holds adds a format here with its migration (MIGRATIONS[n] turns
format n into n + 1) and a fixture of the last release's store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from clipbench.errors import StoreError

KEY = "store_format"
STORE_FORMAT = 2
UNVERSIONED = 1  # a file without the field


def _from_1(data: dict) -> dict:
    return data  # format 2 only adds the version field, which read_format sets


MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _from_1}


def found_format(path: str | Path, data: dict) -> int:
    """The format a store file records (1 when it records none); StoreError for one this release
    cannot read."""
    found = data.get(KEY, UNVERSIONED)
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise StoreError(
            path,
            f"{KEY} is {found!r}, not a results-store format version (expected an integer from 1 to {STORE_FORMAT})",
            "restore the file, or delete it (see `clipbench --version`)",
        )
    if found > STORE_FORMAT:
        raise StoreError(
            path,
            f"written in results-store format {found}; this clipbench reads formats 1 to {STORE_FORMAT}",
            "read it with the clipbench release that wrote it, or upgrade this one "
            "(pip install -U clipbench); `clipbench --version` prints the format a release writes",
        )
    return found


def read_format(path: str | Path, data: dict) -> dict:
    """`data` (a manifest or a status, as read from `path`) migrated to STORE_FORMAT, in memory."""
    fmt = found_format(path, data)
    while fmt < STORE_FORMAT:
        data = MIGRATIONS[fmt](data)
        fmt += 1
    return {**data, KEY: STORE_FORMAT}


def stamp(data: dict) -> dict:
    """`data` as this release writes it: with `store_format: STORE_FORMAT`."""
    return {**data, KEY: STORE_FORMAT}
