"""The registry's errors (deploy/registry.py, deploy/artifacts.py). A RegistryError is a DraftSourceError
(serving/sources.py): replicas see the registry through that protocol and tell its faults from bugs."""
from __future__ import annotations

from serving.sources import DraftSourceError


class RegistryError(DraftSourceError):
    """A registry operation failed; the message says what happened and what to do. (A DraftSourceError:
    replicas see the registry through serving/sources.py.)"""


class UsageError(RegistryError, ValueError):
    """The request itself is wrong (unknown version, malformed candidate folder...): fix the input."""


class ArtifactError(RegistryError):
    """A version's stored artifacts are missing, corrupt or unusable; nothing was changed."""


class RegistryUnavailable(RegistryError):
    """MLflow could not be read or written (server down, database unreadable...): a transient fault, not
    an answer. Nothing was changed; retry later."""


class PromotionsPaused(RegistryError):
    """Promotion refused: promotions are paused (after a rollback) until `draftsmith resume`."""
