"""``tensorhub bench transfer`` end to end at a small size: every figure it names, each
from the runs it says it took."""

from __future__ import annotations

import json
import statistics

import pytest

from tensorhub.bench import transfer

MIB = 1 << 20
FIGURES = {"tcp_vs_raw", "tcp_vs_raw_4mib_chunks", "shm_vs_memcpy", "small_vs_large",
           "publisher_rss_growth_mib", "fetcher_rss_over_size_mib"}


def test_every_figure_from_its_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert transfer.main(["--size", "8MiB", "--runs", "2", "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    figures = {f["name"]: f for f in doc["figures"]}
    assert set(figures) == FIGURES
    for f in figures.values():
        assert f["value"] > 0 and f["better"] in ("higher", "lower"), f
    measured = doc["measured"]
    # small_vs_large: the median rates of the fetches of 10,000 tensors of 4 KiB and of
    # the whole model, over TCP, each as many as --runs
    assert len(measured["small_s"]) == len(measured["tcp_s"]) == 2
    assert measured["small_bytes"] == 10_000 * 4096
    small_rate = measured["small_bytes"] / statistics.median(measured["small_s"])
    tcp_rate = measured["model_bytes"] / statistics.median(measured["tcp_s"])
    assert figures["small_vs_large"]["value"] == pytest.approx(small_rate / tcp_rate,
                                                               rel=1e-3)
    assert "(e) 10,000 x 4 KiB tensors, TCP" in out
    # (h): the same fetch by a reader labelled as another host, which checks each chunk
    # with the manifest's blake3 digests, never the fast local ones
    assert len(measured["far_small_s"]) == 2
    assert measured["far_small_local_digest_chunks"] == [0, 0]
    assert "(h) (e), checked as from another host (blake3)" in out
    # (i): the model fetched while a thread of the fetcher (then of the holder) runs
    # Python, with the switch interval the peer set
    assert len(measured["busy_thread_s"]) == len(measured["busy_holder_s"]) == 2
    assert measured["fetcher_switch_interval"].startswith("0.5 ms: set by")
    assert "(i) (b), a thread of the fetcher running Python" in out
    assert "(i) (b), a thread of the holder running Python" in out
