"""A producer process for the crash and concurrency tests.

    python store_producer_proc.py direct|http TARGET ACKFILE PREFIX N_GROUPS SEED [RESEND]

Writes ``N_GROUPS`` groups ``crash_group(f"{PREFIX}-{i}")`` in batches of 1-4, into the SQLite file
TARGET (``direct``) or through ``m2po store serve`` at URL TARGET (``http``, token from
M2PO_STORE_TOKEN). After each acknowledged put it appends the ids to ACKFILE and fsyncs it, so
a checker knows which groups were acknowledged even if this process is SIGKILLed a moment later.
With RESEND=1 every other batch is sent twice (idempotency under concurrency).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from store_testlib import crash_group  # noqa: E402


def main() -> None:
    mode, target, ackfile, prefix, n, seed = sys.argv[1:7]
    resend = len(sys.argv) > 7 and sys.argv[7] == "1"
    n, rng = int(n), np.random.default_rng(int(seed))
    if mode == "direct":
        from megatron_m2po.store import RolloutStore

        store = RolloutStore(target)
        put = store.put_groups
    else:
        from megatron_m2po.store.client import StoreClient

        client = StoreClient(target, encoding="json" if int(seed) % 2 else "binary", backoff_s=0.05, max_retries=20)
        put = client.put_groups
    fd = os.open(ackfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    print("ready", flush=True)
    i = b = 0
    while i < n:
        k = int(rng.integers(1, 5))
        batch = [crash_group(f"{prefix}-{j}") for j in range(i, min(n, i + k))]
        for _ in range(2 if resend and b % 2 else 1):
            put(batch)
        os.write(fd, "".join(g.group_id + "\n" for g in batch).encode())
        os.fsync(fd)
        i += len(batch)
        b += 1
    os.close(fd)


if __name__ == "__main__":
    main()
