#!/usr/bin/env python
"""Peak memory of ``m2po store serve`` under the most memory-hungry requests we know.

Starts a server (default limits unless ``--max-request-mb``), then for each request resets the
kernel's peak-RSS mark (``/proc/PID/clear_refs`` = 5) and reads ``VmHWM`` after the answer:
the exact peak resident memory the request caused, not a sample. Linux only.

    python tools/store_worst_request.py [--max-request-mb 256]

Requests: JSON bodies at the JSON limit built from the constructs that cost the parser most per
byte (empty lists / objects, short strings, long integer literals), deep nesting, a binary body at
the request limit that is valid (stored) and one whose lengths disagree (refused after reading),
and two request-limit uploads at once (the in-flight budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "store")]

from megatron_m2po.store.codec import (MAX_JSON_BYTES, MAX_JSON_CONTAINERS, MAX_JSON_STRINGS,  # noqa: E402
                                       MAX_TOKENS_PER_ARRAY, encode_binary)
from store_testlib import make_group, start_server, stop  # noqa: E402

TOKEN = "measure"


def post(url, body: bytes, ctype: str) -> int:
    req = urllib.request.Request(url + "/v1/groups", data=body, method="POST",
                                 headers={"Content-Type": ctype, "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def reset_hwm(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def requests(limit: int):
    j = MAX_JSON_BYTES - 64
    yield "JSON [[],[],...] at the JSON limit", b'{"groups": [' + b"[]," * (j // 3) + b"[]]}", "json"
    yield "JSON [{},{},...] at the JSON limit", b'{"groups": [' + b"{}," * (j // 3) + b"{}]}", "json"
    yield 'JSON ["ab","ab",...] at the JSON limit', b'{"groups": [' + b'"ab",' * (j // 5) + b'"ab"]}', "json"
    k = MAX_JSON_CONTAINERS - 8
    yield "JSON [[],...] just under the container limit", b'{"groups": [' + b"[]," * k + b"[]]}", "json"
    k = MAX_JSON_STRINGS - 8
    yield 'JSON ["ab",...] just under the string limit', b'{"groups": [' + b'"ab",' * k + b'"ab"]}', "json"
    yield "JSON 1e5 floats at the JSON limit", b'{"groups": [' + b"1e5," * (j // 4) + b"1]}", "json"
    yield "JSON 40-digit integers at the JSON limit", (b'{"groups": [' + (b"9" * 40 + b",") * (j // 41)
                                                       + b"1]}"), "json"
    yield "JSON nested 1M deep", b'{"groups": ' + b"[" * 1_000_000, "json"
    # a valid binary body near the request limit: trajectories of MAX_TOKENS_PER_ARRAY / 4 tokens
    resp = MAX_TOKENS_PER_ARRAY // 4
    per = resp * 13 + 64
    n = max(1, (limit - 4096) // per)
    g = make_group("big", 0, n=n, resp_len=resp)
    body = encode_binary([g])
    yield f"binary, valid, {len(body) / 2**20:.0f} MiB ({n} x {resp} tokens)", body, "bin"
    yield f"binary, {len(body) / 2**20:.0f} MiB, lengths disagree", body[:-1], "bin"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-request-mb", type=float, default=256.0)
    args = ap.parse_args()
    limit = int(args.max_request_mb * 2**20)
    with tempfile.TemporaryDirectory() as d:
        proc, url = start_server(os.path.join(d, "m.sqlite"), token=TOKEN,
                                 extra=("--max-request-mb", str(args.max_request_mb)))
        try:
            base = hwm_mib(proc.pid)
            print(f"server idle: {base:.0f} MiB peak RSS (request limit {args.max_request_mb:g} MiB, "
                  f"JSON limit {MAX_JSON_BYTES / 2**20:g} MiB)")
            rows = []
            for name, body, kind in requests(limit):
                reset_hwm(proc.pid)
                status = post(url, body, "application/json" if kind == "json" else "application/x-m2po-groups")
                rows.append((name, len(body), status, hwm_mib(proc.pid)))
                print(f"{name:<52} {len(body) / 2**20:8.1f} MiB -> {status}  peak RSS {rows[-1][3]:7.0f} MiB",
                      flush=True)
                del body
            # two request-limit uploads at once: the second waits for budget or gets 429
            resp = MAX_TOKENS_PER_ARRAY // 4
            n = max(1, (limit - 4096) // (resp * 13 + 64))
            bigs = [encode_binary([make_group(f"conc{k}", 0, n=n, resp_len=resp)]) for k in range(2)]
            reset_hwm(proc.pid)
            got: list[int] = []
            ths = [threading.Thread(target=lambda b=b: got.append(post(url, b, "application/x-m2po-groups")))
                   for b in bigs]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            rows.append(("two binary uploads at the limit at once", sum(map(len, bigs)), sorted(got),
                         hwm_mib(proc.pid)))
            print(f"{rows[-1][0]:<52} {rows[-1][1] / 2**20:8.1f} MiB -> {sorted(got)}  peak RSS "
                  f"{rows[-1][3]:7.0f} MiB")
            worst = max(rows, key=lambda r: r[3])
            print(json.dumps({"idle_mib": round(base), "worst": worst[0], "worst_peak_rss_mib": round(worst[3]),
                              "5xx": sum(1 for r in rows for s in (r[2] if isinstance(r[2], list) else [r[2]])
                                         if s >= 500)}))
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
