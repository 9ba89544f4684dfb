"""Artifact cache: accepted wrappers reused across runs, keyed by the 64-hex cache key.

Read before the agent runs (a verified hit skips optimization after the gate's re-check), written after
install. See :mod:`tilesmith.cache.store` for concurrency and failure behaviour and ``docs/cache.md``.

Importing this package does not import torch.
"""

from tilesmith.cache.artifact import Artifact, environment_snapshot, reports_from_track
from tilesmith.cache.store import ArtifactStore, CacheEntry, CacheProblem, PruneResult, QuarantineEntry, source_sha256

__all__ = ["Artifact", "ArtifactStore", "CacheEntry", "CacheProblem", "PruneResult", "QuarantineEntry",
           "environment_snapshot", "reports_from_track", "source_sha256"]
