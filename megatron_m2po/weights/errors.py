"""How a weight push fails: :class:`WeightSyncError`, and the one failure no retry can mend.

The errors sit below every other module of the package so that each can raise them: the stage
senders (:mod:`.stage`), the transports (:mod:`.transport`, :mod:`.disk`, :mod:`.distributed`) and
the FP8 export (:mod:`.fp8`). A push failure crosses ranks as text (rank 0's controller fails, every
rank raises); :func:`weight_sync_error` turns that text back into the right kind.
"""

from __future__ import annotations

from megatron_m2po.utils.errors import UserError
from megatron_m2po.weights.nccl_handshake import MISMATCH

__all__ = ["WeightSyncError", "NcclVersionMismatch", "weight_sync_error"]


class WeightSyncError(RuntimeError):
    """A weight push failed; the message names the engines concerned."""


class NcclVersionMismatch(WeightSyncError, UserError):
    """The trainer and an engine run different NCCL builds: no push can ever succeed, so the push
    is not retried (:mod:`megatron_m2po.weights.nccl_handshake`); ``m2po`` ends with its one line."""


def weight_sync_error(message: str) -> WeightSyncError:
    """The error of a push failure reported as text (across ranks): its kind comes from the text."""
    at = message.find(MISMATCH)
    if at >= 0:
        return NcclVersionMismatch(message[at:].splitlines()[0])
    return WeightSyncError(message)
