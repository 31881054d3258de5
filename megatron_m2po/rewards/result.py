"""The outcome of scoring one batch, shared by every scorer (the process pool, the HTTP reward)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RewardResult", "STATUSES"]

STATUSES = ("correct", "wrong", "no_answer", "ok", "timeout", "error")


@dataclass(slots=True)
class RewardResult:
    """Scores of one batch, in input order.

    Attributes:
        scores: one float per response (timeouts and errors score ``no_answer``).
        statuses: one of ``STATUSES`` per response.
        messages: per-response detail for ``timeout`` / ``error`` (else "").
        n_timeouts / n_errors / n_no_answer / n_correct / n_wrong: counts over the batch
            (``n_no_answer`` counts only genuine missing answers, not timeouts or errors).
        elapsed_s: wall time of the scoring call.
    """

    scores: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    n_timeouts: int = 0
    n_errors: int = 0
    n_no_answer: int = 0
    n_correct: int = 0
    n_wrong: int = 0
    elapsed_s: float = 0.0

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def accuracy(self) -> float:
        """Fraction verified correct (math reward); 0 for an empty batch."""
        return self.n_correct / len(self.scores) if self.scores else 0.0

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat metrics for logging (counts are sums; reduce across producers by summing)."""
        n = len(self.scores)
        return {
            f"{prefix}mean": sum(self.scores) / n if n else 0.0,
            f"{prefix}acc": self.accuracy,
            f"{prefix}n": float(n),
            f"{prefix}n_timeouts": float(self.n_timeouts),
            f"{prefix}n_errors": float(self.n_errors),
            f"{prefix}n_no_answer": float(self.n_no_answer),
            f"{prefix}score_s": self.elapsed_s,
        }
