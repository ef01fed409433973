"""How long a step waits for its data, with and without the read ahead (``data/dataset.Prefetcher``),
from local disk and from an S3 endpoint (moto's server on loopback: a stand-in for a bucket,
its latency is loopback's and moto's, not a real store's). Each step "trains" for a fixed time
(a sleep), as the engine does between two reads; the wait is what ``get`` takes.

    .venv/bin/python bench/data_wait.py [--steps 20] [--step-s 0.1] [--global-batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the S3 server


def measure(path: str, steps: int, step_s: float, batch: int, seq_len: int, ahead: bool) -> list[float]:
    from trainmesh.data.dataset import Prefetcher, TokenDataset
    from trainmesh.data.shards import TokenStream

    data = TokenDataset(TokenStream(path), seq_len)

    def fetch(step: int):
        return data.microbatches(0, step, batch, 0, 1, 4)

    prefetch = Prefetcher(fetch) if ahead else None
    waits = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            prefetch.get(step) if prefetch else fetch(step)
            waits.append(time.perf_counter() - t0)
            time.sleep(step_s)  # the step's compute
    finally:
        if prefetch:
            prefetch.close()
    return waits[1:]  # (the first step has nothing ahead of it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()

    import contextlib

    from servers import S3Server

    from trainmesh.cli.main import main as cli
    from trainmesh.data import corpus

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        docs = Path(tmp) / "docs.jsonl"
        docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.documents(4000)))
        local = str(Path(tmp) / "local")
        assert cli(["data", "prepare", str(docs), "--out", local]) == 0
        server = S3Server(Path(tmp) / "s3")
        server.start()
        try:
            stack.enter_context(server.client_env())
            remote = f"s3://{server.bucket()}/data"
            assert cli(["data", "prepare", str(docs), "--out", remote]) == 0
            print(f"steps {args.steps}, each {args.step_s * 1e3:.0f} ms of compute, "
                  f"{args.global_batch} windows of {args.seq_len} tokens a step "
                  "(S3: moto's server on loopback)")
            print(f"{'source':>12} {'read ahead':>10} {'wait ms (median)':>17} {'max':>8} "
                  f"{'wait / step':>11}")
            for name, path in (("local disk", local), ("s3 loopback", remote)):
                for ahead in (False, True):
                    w = measure(path, args.steps, args.step_s, args.global_batch, args.seq_len, ahead)
                    med = statistics.median(w)
                    print(f"{name:>12} {'yes' if ahead else 'no':>10} {med * 1e3:>17.2f} "
                          f"{max(w) * 1e3:>8.2f} {med / (med + args.step_s):>10.1%}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
