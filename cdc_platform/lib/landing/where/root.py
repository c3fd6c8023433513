"""A landing root as the zone it names: a folder (``LocalZone``) or an S3 prefix
(``S3Landing``). The one place that knows every kind of zone, so ``zone`` (the interface and
the folder) and ``object_store`` (the bucket) never import each other."""

from __future__ import annotations

from cdc_platform.lib.landing.where.object_store import S3Landing
from cdc_platform.lib.landing.where.zone import Landing, LandingZone, LocalZone
from cdc_platform.lib.storage.stores import Location

__all__ = ["zone_at"]


def zone_at(root: Landing) -> LandingZone:
    """``root`` as a zone: a zone as it is, an ``s3://`` Location or URI, else a folder."""
    if isinstance(root, LandingZone):
        return root
    location = Location.of(root)
    if location.is_local:
        return LocalZone(location.path)
    return S3Landing(location)
