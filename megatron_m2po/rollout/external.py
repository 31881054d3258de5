"""Moved: the producer API is :mod:`megatron_m2po.ingestion.producer` (external ingestion is one
package, ``megatron_m2po/ingestion/``). This alias keeps producers written against the old path
working, with a ``DeprecationWarning`` naming the new one; it will be removed in a later release."""

from __future__ import annotations

import warnings

from megatron_m2po.ingestion import producer as _producer

warnings.warn("megatron_m2po.rollout.external moved to megatron_m2po.ingestion.producer; "
              "change the import (this alias will be removed)", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_producer, name)


def __dir__() -> list[str]:
    return dir(_producer)
