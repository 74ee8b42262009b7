"""Serialization cost of a large CompletionRecord: orjson over model_dump vs pydantic's own JSON.

Prints per-record milliseconds for a 100k-token prompt + 10k-token response, both directions.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_env.records import CompletionRecord  # noqa: E402
from tests.test_records import big_record  # noqa: E402


def timed(fn, repeat: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    rec = big_record(100_000)
    blob = rec.to_json()
    rows = [
        ("dump  orjson(model_dump)   [ours]", timed(rec.to_json)),
        ("dump  pydantic model_dump_json", timed(rec.model_dump_json)),
        ("load  orjson + model_validate [ours]", timed(lambda: CompletionRecord.from_json(blob))),
        ("load  pydantic model_validate_json", timed(lambda: CompletionRecord.model_validate_json(blob))),
    ]
    print(f"record: {len(rec.prompt_ids):,} prompt ids, {len(rec.response_ids):,} response ids, {len(blob)/1e6:.2f} MB JSON")
    for name, ms in rows:
        print(f"{name:40s} {ms:8.2f} ms")
    print(f"ratio dump pydantic/ours: {rows[1][1] / rows[0][1]:.2f}x   load pydantic/ours: {rows[3][1] / rows[2][1]:.2f}x")


if __name__ == "__main__":
    main()
