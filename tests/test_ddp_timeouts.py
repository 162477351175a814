"""A rank that exits or hangs during a statistics sync, in a real gloo group.

Three ranks on the loopback interface; rank 1 misbehaves, ranks 0 and 2 must
raise ``DistributedSyncError`` within the configured timeout (never hang),
naming the observer and the collective that failed. Each healthy rank writes
what it saw to a file and leaves with ``os._exit`` (the group is out of step:
tearing it down could itself wait); this process kills rank 1 when it is still
alive (the hanging rank) after the healthy ranks reported.

- exits: rank 1 syncs the first observer, then exits before the second;
  timeout from OBSKERNELS_SYNC_TIMEOUT.
- hangs before a sync: rank 1 syncs the first observer, then sleeps; timeout
  from ``sync_timeout``.
- hangs inside a sync: rank 1 joins the header all_gather but never the
  all_reduce of the statistics; through ``calibration.sync_observer_stats``
  with its ``timeout`` argument (the error also names the module).
"""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compressed_tensors.quantization import QuantizationArgs

from obskernels import Observer, set_backend
from obskernels.observers.sync import DistributedSyncError, get_sync_timeout, sync_timeout

WORLD = 3
FAULTY = 1
TIMEOUT = 2.0
# gloo setup, fork and the report: what a healthy rank may take beyond the timeout
SLACK = 6.0
ARGS = dict(num_bits=8, symmetric=True, strategy="tensor")


def _observers():
    make = Observer.load_from_registry
    first = make("static_minmax", base_name="input", args=QuantizationArgs(**ARGS))
    second = make("minmax", base_name="output", args=QuantizationArgs(**ARGS))
    return first, second


def _sync(observer):
    for handle in observer.sync_activation_stats():
        handle.wait()


def _report(out_dir, rank, res):
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def _worker(rank, init_file, out_dir, scenario):
    torch.set_num_threads(1)
    set_backend("reference")
    if os.path.exists("/sys/class/net/lo"):  # loopback only, whatever the hostname resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # the group's own timeout is long: only obskernels' timeout can end the wait
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    res = {"error": None}
    try:
        first, second = _observers()
        first(torch.randn(4, 8) + rank)
        second(torch.randn(4, 8) - rank)
        if scenario == "exits":
            os.environ["OBSKERNELS_SYNC_TIMEOUT"] = str(TIMEOUT)
            _sync(first)
            if rank == FAULTY:
                os._exit(0)
            t0 = time.monotonic()
            try:
                _sync(second)
            finally:
                res["seconds"] = time.monotonic() - t0
        elif scenario == "hangs_before":
            with sync_timeout(TIMEOUT):
                _sync(first)
                if rank == FAULTY:
                    time.sleep(120)
                t0 = time.monotonic()
                try:
                    _sync(second)
                finally:
                    res["seconds"] = time.monotonic() - t0
        elif scenario == "hangs_inside":
            from obskernels.calibration import sync_observer_stats

            layer = torch.nn.Linear(8, 8)
            layer.register_module("input_observer", first)
            if rank == FAULTY:
                dist.all_reduce = lambda *a, **k: time.sleep(120)  # joins the all_gather only
            t0 = time.monotonic()
            try:
                sync_observer_stats([layer], timeout=TIMEOUT)
            finally:
                res["seconds"] = time.monotonic() - t0
        res["synced"] = True
    except DistributedSyncError as exc:
        res["error"] = str(exc)
    except Exception as exc:  # the wrong kind of error is a failure, reported
        res["error"] = f"UNEXPECTED {type(exc).__name__}: {exc}"
    _report(out_dir, rank, res)
    os._exit(0)


def _run(tmp_path, scenario):
    ctx = mp.start_processes(
        _worker, args=(str(tmp_path / "rendezvous"), str(tmp_path), scenario), nprocs=WORLD,
        join=False, start_method="spawn" if torch.cuda.is_initialized() else "fork",
    )
    healthy = [r for r in range(WORLD) if r != FAULTY]
    deadline = time.monotonic() + 30
    try:
        for r in healthy:
            ctx.processes[r].join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in ctx.processes:  # only the processes started here
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = [r for r in healthy if not (tmp_path / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} did not report within 30 s (a hang)"
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in healthy}


def _check(results, observer, collective):
    for r, res in results.items():
        err = res["error"]
        assert err is not None and not err.startswith("UNEXPECTED"), f"rank {r}: {err}"
        assert observer in err, f"rank {r}: observer not named: {err}"
        assert collective in err, f"rank {r}: collective not named: {err}"
        assert f"rank {r} of {WORLD}" in err, err
        assert res["seconds"] < TIMEOUT + SLACK, f"rank {r} took {res['seconds']:.1f} s: {err}"


@pytest.mark.slow
def test_rank_exits_before_a_sync(tmp_path):
    results = _run(tmp_path, "exits")
    _check(results, "MinMaxObserver(base_name='output')", "all_gather of the statistic headers")
    assert all("timeout 2 s" in res["error"] for res in results.values())


@pytest.mark.slow
def test_rank_hangs_before_a_sync(tmp_path):
    results = _run(tmp_path, "hangs_before")
    _check(results, "MinMaxObserver(base_name='output')", "all_gather of the statistic headers")
    for r, res in results.items():
        # it waited for the timeout: the error is the timeout, not a closed connection
        assert res["seconds"] >= TIMEOUT * 0.9, (r, res)
        assert "timeout 2 s" in res["error"], res["error"]


@pytest.mark.slow
def test_rank_hangs_inside_a_sync(tmp_path):
    results = _run(tmp_path, "hangs_inside")
    _check(results, "StaticMinMaxObserver(base_name='input')", "all_reduce(MIN) of min_vals")
    for res in results.values():
        assert "input_observer" in res["error"] and "Linear" in res["error"], res["error"]
        assert res["seconds"] >= TIMEOUT * 0.9


def test_timeout_settings(monkeypatch):
    monkeypatch.delenv("OBSKERNELS_SYNC_TIMEOUT", raising=False)
    assert get_sync_timeout() is None
    monkeypatch.setenv("OBSKERNELS_SYNC_TIMEOUT", "7.5")
    assert get_sync_timeout() == 7.5
    with sync_timeout(3):
        assert get_sync_timeout() == 3.0
    assert get_sync_timeout() == 7.5
    for bad in (0, -1, float("nan"), float("inf"), "soon"):
        with pytest.raises(ValueError, match="seconds > 0"):
            with sync_timeout(bad):
                pass
    monkeypatch.setenv("OBSKERNELS_SYNC_TIMEOUT", "-3")
    with pytest.raises(ValueError, match="OBSKERNELS_SYNC_TIMEOUT must be a number of seconds > 0"):
        get_sync_timeout()
