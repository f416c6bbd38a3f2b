"""benchmarks/fuzz.py at a tiny size: the three processes run, every generated frame goes
out, the target neither dies nor logs a traceback, the honest trainer is served before,
during and after, and the last line is the JSON object of the documented shape. Also the
mutation engine (pure) and the corpus: valid frames of every served kind."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from wanswarm.transport.framing import HeaderReceived, StreamDecoder

from tests.benchmark_loader import BENCHMARKS, load_benchmark

bench = load_benchmark("fuzz.py", "bench_fuzz")


def test_mutations_are_seeded_and_bounded() -> None:
    data = bytes(range(200))
    first = [bench.mutate(data, random.Random(seed)) for seed in range(50)]
    assert first == [bench.mutate(data, random.Random(seed)) for seed in range(50)]
    assert sum(m != data for m in first) >= 45
    assert all(len(m) <= len(data) * 5 + 200 for m in first)


def test_corpus_holds_valid_requests_of_every_kind() -> None:
    kinds = ["forward", "backward", "stage_info", "run_spec", "_observe"]
    corpus = bench.Corpus(kinds, "run", "trainer", random.Random(1))
    seen = set()
    for case in corpus.cases:
        decoder = StreamDecoder(bench.transport_config().limits, allow_auth=True)
        for event in decoder.feed(b"".join(case)):
            if isinstance(event, HeaderReceived) and event.header.type == "request":
                seen.add(event.header.kind)
    assert seen == set(kinds)
    assert corpus.datagrams and len(corpus.initial) >= 1200


def test_a_small_fuzz_run_crashes_nothing_and_serves_the_honest_trainer() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fuzz.py"), "--frames", "2000", "--json",
         "--baseline-requests", "5"],
        capture_output=True, text=True, timeout=240, check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["frames"] >= 2000 and result["crashes"] == 0 and result["target_alive"]
    for phase in ("honest_baseline", "honest_during_fuzz", "honest_after"):
        assert result[phase]["success"] == 1.0, result[phase]
    counts = result["fuzzer"]["counts"]
    assert counts["stream_frames"] and counts["quic_datagrams"] and counts["udp_datagrams"]
