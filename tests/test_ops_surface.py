"""The operator's surface: Prometheus metrics scraped over HTTP from a peer process,
``tensorhub status`` (JSON and ``--watch``) against a live mesh, per-link rates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import trio
from helpers import open_mesh
from safetensors.numpy import save_file

import tensorhub
from tensorhub.ops import commands as cli_ops
from tensorhub.ops.metrics import serve_metrics
from tensorhub.ops.status import Rates
from tensorhub.processes import LineProcess, free_ports
from tensorhub.protocol import codec
from tensorhub.protocol.messages import register_all
from tensorhub.protocol.opstatus import (
    MAX_HELD,
    MAX_LINKS,
    HeldVersion,
    LinkBytes,
    StatusReply,
    encode_reply,
)

CLI = [sys.executable, "-m", "tensorhub.cli"]
WEIGHTS = {"w": np.arange(200_000, dtype=np.float32), "b": np.ones(10, np.float16)}
NBYTES = sum(a.nbytes for a in WEIGHTS.values())


@pytest.fixture
def mesh(tmp_path: Path, procs: list[LineProcess]) -> tuple[list[int], list[LineProcess]]:
    """Ports [publisher, cache, metrics], and the processes started (killed at the end)."""
    save_file(WEIGHTS, str(tmp_path / "m.safetensors"))
    return free_ports(3), procs


def _start(procs: list[LineProcess], name: str, *argv: str) -> LineProcess:
    p = LineProcess(name, [*CLI, *argv, "--preset", "local"])
    procs.append(p)
    return p


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(tensorhub_\S+) (\S+)$", text, re.M)}


def test_metrics_scraped_over_http_move_after_a_fetch(
        tmp_path: Path, mesh: tuple[list[int], list[LineProcess]]) -> None:
    ports, procs = mesh
    cache = _start(procs, "cache", "peer", "--name", "cache", "--listen",
                   f"127.0.0.1:{ports[1]}", "--follow", "m", "--metrics-port", str(ports[2]))
    assert cache.expect("metrics", 60)["url"].endswith(f":{ports[2]}/metrics")
    before = _scrape(ports[2])
    assert before["tensorhub_fetches_total"] == 0
    assert before["tensorhub_versions_held"] == 0
    assert "tensorhub_gossip_queue_depth{queue=\"inbound\"}" in before
    _start(procs, "pub", "publish", str(tmp_path / "m.safetensors"), "--model", "m",
           "--version", "1", "--name", "pub", "--listen", f"127.0.0.1:{ports[0]}",
           "--join", f"127.0.0.1:{ports[1]}").expect("serving", 60)
    assert cache.expect("followed", 60)["version"] == 1
    after = _scrape(ports[2])
    assert after["tensorhub_fetches_total"] == 1
    assert after["tensorhub_fetched_bytes_by_transport_total{transport=\"tcp\"}"] == NBYTES
    assert after["tensorhub_fetched_bytes_by_source_total{source=\"pub\"}"] == NBYTES
    assert after["tensorhub_fetch_stage_total{stage=\"fetch\"}"] == 1
    assert after["tensorhub_fetch_stage_seconds_total{stage=\"fetch\"}"] > 0
    assert after["tensorhub_fetch_stage_total{stage=\"plan\"}"] == 1  # asked the coordinator
    # asked while the manifest was read, before the chunks' phase ("fetch") began
    assert after["tensorhub_fetch_stage_seconds_total{stage=\"plan\"}"] > 0
    assert after["tensorhub_versions_held"] == 1 and after["tensorhub_held_bytes"] == NBYTES
    assert after["tensorhub_members{state=\"alive\"}"] == 2  # pub, and itself
    assert not [k for k in after if k.startswith("tensorhub_integrity_failures")]


async def test_a_scrape_shows_the_plan_and_switch_stages_of_a_rollout() -> None:
    """A rollout's fetches time the plan; its commits time the swap, counted after the
    fetch's report was taken; a scrape over HTTP shows both stages."""
    async with open_mesh(2) as (pub, roll), serve_metrics(roll, 0) as port:
        rollout = tensorhub.Rollout(roll, "m")
        done = []
        for version in (1, 2):
            await pub.publish("m", version, {"w": np.full(1000, version, np.float32)})
            with trio.fail_after(10):
                while (roll.control.latest("m") or 0) < version:
                    await roll.wait_changed()
            staged = await rollout.stage(version)
            assert staged.fetched.report.plan_seconds is not None
            assert " epoch " in staged.fetched.report.plan  # a coordinator answered
            done.append(await staged.commit())
            assert staged.fetched.report.switch_seconds == done[-1].switch_seconds
        scraped = await trio.to_thread.run_sync(_scrape, port)  # the loop answers it
        plans = [r["plan_seconds"] for r in roll.statistics().reports]
    assert roll.statistics().switches == 2
    assert scraped["tensorhub_fetch_stage_total{stage=\"plan\"}"] == 2
    assert scraped["tensorhub_fetch_stage_seconds_total{stage=\"plan\"}"] == \
        pytest.approx(sum(plans))
    assert scraped["tensorhub_fetch_stage_total{stage=\"switch\"}"] == 2
    assert scraped["tensorhub_fetch_stage_seconds_total{stage=\"switch\"}"] == \
        pytest.approx(sum(d.switch_seconds for d in done))
    assert scraped["tensorhub_fetch_stage_total{stage=\"fetch\"}"] == 2


async def test_a_scrape_times_cast_only_for_fetches_that_cast_and_counts_bad_chunks(
        ) -> None:
    """``stage="cast"`` counts the fetches that cast a tensor (a report's cast_seconds is
    0.0 otherwise); a source whose chunks fail their digest gets its own series."""
    pytest.importorskip("torch")
    from corrupting import corrupt_served

    # Full chunks only: the corrupting hook spoils served chunks, not deltas, and a
    # delta against the version before would otherwise be chosen where the measured
    # link is slower than encoding (a loaded host).
    async with open_mesh(2, planning=False, stall_timeout=0.5, delta="off") as (pub, reader), \
            serve_metrics(reader, 0) as port:
        for version in (1, 2, 3):
            await pub.publish("m", version, {"w": np.full(1000, version, np.float32)})
        with trio.fail_after(10):
            while (reader.control.latest("m") or 0) < 3:
                await reader.wait_changed()
        await reader.fetch("m", 1)
        plain = await trio.to_thread.run_sync(_scrape, port)
        cast = await reader.fetch("m", 2, cast="bfloat16")
        casting = await trio.to_thread.run_sync(_scrape, port)
        corrupt_served(pub, 10**6)
        with pytest.raises(tensorhub.VersionUnavailable):
            await reader.fetch("m", 3)
        bad = await trio.to_thread.run_sync(_scrape, port)
        failures = reader.statistics().integrity_failures["p0"]
    assert cast.report.cast == {"w": "float32->bfloat16"}
    assert plain["tensorhub_fetch_stage_total{stage=\"fetch\"}"] == 1
    assert 'tensorhub_fetch_stage_total{stage="cast"}' not in plain
    assert casting["tensorhub_fetch_stage_total{stage=\"fetch\"}"] == 2
    assert casting["tensorhub_fetch_stage_total{stage=\"cast\"}"] == 1
    assert casting["tensorhub_fetch_stage_seconds_total{stage=\"cast\"}"] == \
        pytest.approx(cast.report.cast_seconds)
    for stage in ("first_byte", "transfer", "verify"):
        assert casting[f'tensorhub_fetch_stage_total{{stage="{stage}"}}'] == 2
    assert not [k for k in casting if k.startswith("tensorhub_integrity_failures")]
    assert failures >= 1
    assert bad['tensorhub_integrity_failures_total{source="p0"}'] == failures


def test_status_json_and_watch_show_holders_bytes_and_staleness(
        tmp_path: Path, mesh: tuple[list[int], list[LineProcess]]) -> None:
    ports, procs = mesh
    _start(procs, "pub", "publish", str(tmp_path / "m.safetensors"), "--model", "m",
           "--version", "1", "--name", "pub", "--listen",
           f"127.0.0.1:{ports[0]}").expect("serving", 60)
    cache = _start(procs, "cache", "peer", "--name", "cache", "--listen",
                   f"127.0.0.1:{ports[1]}", "--join", f"127.0.0.1:{ports[0]}",
                   "--follow", "m")
    assert cache.expect("followed", 60)["version"] == 1
    status = [*CLI, "status", "--preset", "local", "--join", f"127.0.0.1:{ports[0]}",
              "--settle", "1"]
    out = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["health"] == {"alive": 2}
    assert report["members"]["cache"]["fetched"] == NBYTES
    assert report["members"]["pub"]["served"] == NBYTES
    assert report["versions"]["m@1"]["bytes"] == NBYTES
    assert sorted(report["versions"]["m@1"]["holders"]) == ["cache", "pub"]
    assert {(s["member"], s["behind"]) for s in report["staleness"]} == {
        ("cache", 0), ("pub", 0)}
    watch = subprocess.run([*status, "--watch", "--count", "1"], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, COLUMNS="100"))
    assert watch.returncode == 0, watch.stderr
    screen = watch.stdout
    for text in ("alive 2", "cache", "pub (1/1)", "m@1", "transfers in flight",
                 "staleness"):
        assert text in screen, screen


def test_rates_are_bytes_between_reports_over_the_time_between() -> None:
    rates = Rates()

    def report(t: float, nbytes: int) -> dict[str, object]:
        return {"time": t, "links": [{"dest": "a", "source": "b", "model": "m",
                                      "version": 1, "bytes": nbytes}]}
    first, second = report(10.0, 1000), report(12.0, 5000)
    rates.add(first)
    rates.add(second)
    assert first["links"][0]["rate"] is None  # type: ignore[index]
    assert second["links"][0]["rate"] == 2000.0  # type: ignore[index]


def test_plain_progress_rate_counts_from_the_fetch_not_the_wait_for_a_version(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``tensorhub fetch`` off a terminal: the line's rate is bytes over the time since
    the first report, so the seconds spent waiting for the version do not count."""
    now = [0.0]
    monkeypatch.setattr(cli_ops.time, "monotonic", lambda: now[0])
    show = cli_ops._Plain("fetch m@2")  # made when the command starts
    now[0] = 30.0  # the version appeared and its fetch began 30 s later
    show(0, 400_000_000)
    now[0] = 32.0
    show(200_000_000, 400_000_000)
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "fetch m@2:  50.0% 200000000/400000000 bytes 100.0 MB/s"
    quick = cli_ops._Plain("fetch m@3")  # a fetch too short to be seen in flight
    quick(10, 10)
    assert capsys.readouterr().err == "fetch m@3: 100.0% 10/10 bytes\n"


def test_a_status_reply_at_its_bounds_fits_the_smallest_frame() -> None:
    register_all()
    name = "m" * 200
    reply = StatusReply(
        7, "p" * 200, tuple(HeldVersion(name, v, 0, 1 << 40, 3, 9) for v in range(MAX_HELD)),
        tuple(LinkBytes(name, v, "s" * 200, "tcp", 5, 10) for v in range(MAX_LINKS)),
        1, 2, 3, 4, 5)
    smallest = 64 << 10  # PeerConfig refuses a smaller max_message_bytes
    data = encode_reply(reply, smallest)
    assert len(data) <= smallest
    back = codec.decode(data, smallest)
    assert isinstance(back, StatusReply) and back.held and back.links
    assert len(back.held) + len(back.links) + back.left_out == MAX_HELD + MAX_LINKS
    assert back.held == reply.held[:len(back.held)]


@pytest.mark.parametrize("argv", [
    ["status", "--join", "127.0.0.1:1", "--watch", "--count", "1"],
    ["peer", "--name", "x", "--metrics-port", "1"]])
def test_without_the_ops_extra_the_command_says_how_to_install(argv: list[str]) -> None:
    hide = ("import sys; sys.modules['rich'] = sys.modules['prometheus_client'] = None; "
            "from tensorhub.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", hide, *argv, "--preset", "local"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pip install 'tensorhub[ops]'" in out.stderr, out.stderr


def test_members_answer_status_queries_in_a_closed_mesh(
        tmp_path: Path, mesh: tuple[list[int], list[LineProcess]]) -> None:
    ports, procs = mesh
    keys = str(tmp_path / "keys")
    subprocess.run([*CLI, "keygen", keys, "--peer", "pub", "--peer", "obs", "--publisher",
                    "m=pub"], check=True, capture_output=True, timeout=60)
    _start(procs, "pub", "publish", str(tmp_path / "m.safetensors"), "--model", "m",
           "--version", "1", "--name", "pub", "--keys", keys, "--listen",
           f"127.0.0.1:{ports[0]}").expect("serving", 60)
    out = subprocess.run([*CLI, "status", "--preset", "local", "--join",
                          f"127.0.0.1:{ports[0]}", "--settle", "1", "--json", "--keys", keys,
                          "--name", "obs"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["members"]["pub"]["answered"] is True
    assert report["versions"]["m@1"]["bytes"] == NBYTES
