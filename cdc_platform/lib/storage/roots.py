"""Where the operator jobs may read from: re-sync snapshots and adoption sources.

A run's config is typed by whoever can reach the Launchpad, and the service can read far more
than a table's data: the keyring, another table's history or change log (decrypted rows), a
bucket it reaches with the warehouse's credentials. So a snapshot or an adoption source is
only read from under a root the platform config allows (``snapshot_roots``,
``adoption_roots``; none configured: refused, saying which key to set), and never from inside
the warehouse or the landing root (nor from a folder holding either).

Local paths are compared as the file system resolves them, and a path with a symlink anywhere
in it is refused (the one a run gives must be the real one; a link could point anywhere after
the check). Object-store URIs are compared by normalized scheme, bucket and ``/``-separated
prefix, and a ``.`` or ``..`` segment (also percent-encoded) is refused. A glob character
(``{ } [ ] * ? \\``, also percent-encoded in a URI) in a source or a root is refused: Spark's
file reader expands ``n{/..}{/..}{/warehouse}`` to ``n/../../warehouse``, a path no segment
check sees leaving the root.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.storage.stores import GLOB_CHARACTERS, Location, Where

SNAPSHOT_ROOTS = "snapshot_roots"
ADOPTION_ROOTS = "adoption_roots"


class SourceRootError(Refusal):
    """A snapshot or adoption source outside what the config allows; nothing was read."""


def _segments(location: Location) -> tuple[str, ...]:
    """The location as comparable parts: scheme, bucket, then each path segment (decoded)."""
    if location.is_local:
        return ("file", *Path(location.uri).parts)
    parts = urlsplit(location.uri)
    segments = [unquote(s) for s in parts.path.split("/") if s]
    return (location.scheme, parts.netloc.lower(), *segments)


def is_within(inner: Location, outer: Location) -> bool:
    """True if ``inner`` is ``outer`` or below it (whole segments: ``a/bc`` is not in ``a/b``)."""
    a, b = _segments(inner), _segments(outer)
    return a[: len(b)] == b


def overlaps(a: Location, b: Location) -> bool:
    return is_within(a, b) or is_within(b, a)


def checked_root(value: Where, what: str, *, source: bool = False) -> Location:
    """A configured root: a resolved local folder or an object-store URI without ``.``/``..``;
    a root operator jobs read from (``source``: ``snapshot_roots``, ``adoption_roots``) also
    without glob characters."""
    location = Location.of(value)
    if location.is_local:
        location = Location.of(Path(location.uri).resolve())
    else:
        _refuse_dot_segments(location, what)
    if source:
        _refuse_glob(location.uri, location, what)
    return location


def _refuse_glob(text: str, location: Location, what: str) -> None:
    """Refuse a path Spark's file reader would read as a pattern: a glob character in the
    text given, or (in a URI) in a percent-decoded segment."""
    found = {c for c in text if c in GLOB_CHARACTERS}
    if not location.is_local:
        found |= {c for s in _segments(location)[2:] for c in s if c in GLOB_CHARACTERS}
    if found:
        raise SourceRootError(
            f"{what} {text}: glob characters ({' '.join(sorted(found))}) are not allowed: Spark"
            " reads them as a pattern, which may lead out of the root ('{/..}'); rename the"
            " folder"
        )


def _refuse_dot_segments(location: Location, what: str) -> None:
    if any(s in (".", "..") for s in _segments(location)[2:]):
        raise SourceRootError(f"{what} {location.uri}: '.' and '..' segments are not allowed")


def _refuse_links(path: Path, what: str) -> None:
    """Refuse a local path with a symlink in any of its parts (it must be the real path)."""
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return  # the caller says what is missing
        if stat.S_ISLNK(mode):
            raise SourceRootError(
                f"{what} {path}: {current} is a symlink; give the real path (links are not"
                " followed)"
            )


def _check_placement(
    location: Location, roots: Sequence[Location], forbidden: Sequence[Location], what: str
) -> None:
    for root in forbidden:
        if overlaps(location, root):
            raise SourceRootError(
                f"{what} {location.uri}: overlaps the platform's own folder {root.uri}"
                " (the warehouse and the landing zone are never a source)"
            )
    if not any(is_within(location, root) for root in roots):
        raise SourceRootError(
            f"{what} {location.uri} is not under any of the allowed roots"
            f" ({', '.join(r.uri for r in roots)})"
        )


def _no_roots(key: str, what: str) -> SourceRootError:
    return SourceRootError(
        f"no {what} is allowed: the platform config sets no '{key}'. List the folders (or"
        f" object-store prefixes) a {what} may come from, e.g. `{key}: [/data/{what}s]`"
    )


def _given(
    source: Where, key: str, roots: Sequence[Where], forbidden: Sequence[Where], what: str
) -> tuple[str, Location, list[Location], list[Location]]:
    """What a snapshot and an adoption source check first, in this order: some root is
    configured under ``key``, the text given is a location without glob characters, and the
    roots are sound. Returns (the text, its location, the allowed roots, the forbidden ones)."""
    if not roots:
        raise _no_roots(key, what)
    text = source.uri if isinstance(source, Location) else os.fspath(source)
    try:
        location = Location.of(text)
    except ValueError as exc:
        raise SourceRootError(f"{what}: {exc}") from None
    _refuse_glob(text, location, what)
    allowed = [checked_root(r, f"{key} entry", source=True) for r in roots]
    denied = [checked_root(f, "root") for f in forbidden]
    return text, location, allowed, denied


def snapshot_folder(
    snapshot: Where, roots: Sequence[Where], forbidden: Sequence[Where] = ()
) -> Path | Location:
    """The re-sync snapshot folder a run names, checked: under one of ``roots``
    (``snapshot_roots``), apart from ``forbidden`` (the landing and warehouse roots), with no
    glob character; a local one absolute and real (no symlink in it), an ``s3://`` prefix
    without ``.``/``..`` segments (returned as a Location). Raises SourceRootError saying why."""
    what = "snapshot"
    text, location, allowed, denied = _given(snapshot, SNAPSHOT_ROOTS, roots, forbidden, what)
    if not location.is_local:
        if location.scheme != "s3":
            raise SourceRootError(f"{what} {text}: a snapshot is a folder or an s3:// prefix")
        _refuse_dot_segments(location, what)
        _check_placement(location, allowed, denied, what)
        return location
    if "://" not in text and not os.path.isabs(text):
        raise SourceRootError(f"{what} {text!r}: give an absolute path")
    path = Path(location.uri)  # normalized: '..' segments are resolved lexically
    if ".." in Path(text.removeprefix("file://")).parts:
        raise SourceRootError(f"{what} {text}: '..' segments are not allowed")
    _refuse_links(path, what)
    _check_placement(location, allowed, denied, what)
    return path


def adoption_source(
    source: Where, roots: Sequence[Where], forbidden: Sequence[Where] = ()
) -> Location:
    """The adoption source a run names, checked: under one of ``roots`` (``adoption_roots``),
    apart from ``forbidden`` (the warehouse and landing roots); a local one absolute, real
    and with no symlink inside it; a URI without ``.``/``..`` segments; neither with a glob
    character."""
    what = "adoption source"
    text, location, allowed, denied = _given(source, ADOPTION_ROOTS, roots, forbidden, what)
    if location.is_local:
        if "://" not in text and not os.path.isabs(text):
            raise SourceRootError(f"{what} {text!r}: give an absolute path or a URI")
        if ".." in Path(text.removeprefix("file://")).parts:
            raise SourceRootError(f"{what} {text}: '..' segments are not allowed")
        _refuse_links(Path(location.uri), what)
        _check_placement(location, allowed, denied, what)
        _refuse_links_below(Path(location.uri), what)
        return location
    _refuse_dot_segments(location, what)
    _check_placement(location, allowed, denied, what)
    return location


def _refuse_links_below(folder: Path, what: str) -> None:
    """A local source folder holds no symlink: Spark would follow it out of the root."""
    if not folder.is_dir():
        return
    for parent, dirs, names in os.walk(folder):
        for name in [*dirs, *names]:
            if os.path.islink(os.path.join(parent, name)):
                raise SourceRootError(
                    f"{what} {folder}: {os.path.join(parent, name)} is a symlink (links are"
                    " not followed)"
                )
