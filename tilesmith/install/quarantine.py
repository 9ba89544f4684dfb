"""Quarantining an installed artifact after a production failure (used by :mod:`tilesmith.install.verify` and
:mod:`tilesmith.install.installer`)."""

from __future__ import annotations

from tilesmith import settings
from tilesmith.context import RunContext


def quarantine(run: RunContext, key: str, source: str, graph_name: str, reason: str) -> str:
    """Quarantine the artifact of ``key`` with ``source`` in the cache (never served or stored again:
    :meth:`tilesmith.cache.ArtifactStore.quarantine`); returns the sentence for the diagnostic."""
    from tilesmith.cache import ArtifactStore

    try:
        store = ArtifactStore(settings.cache_root())
        path = store.quarantine(key, source=source, graph_name=graph_name, run_id=getattr(run, "run_id", None),
                                reason=reason[:2000])
        for diag in store.take_problems():
            run.record_diagnostic(diag)
    except Exception as exc:  # noqa: BLE001
        return f"Quarantining artifact {key[:12]} failed ({exc}); it may be served again."
    if path is None:
        return (f"Artifact {key[:12]} is not quarantined: the artifact cache is off "
                "(TILESMITH_ARTIFACT_CACHE=0) or could not be written.")
    return f"Artifact {key[:12]} is quarantined ({path}) and will not be served again."
