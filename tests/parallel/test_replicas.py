"""Serving on several ranks: a multi-rank replica in lock-step under the scheduler, and dp replicas behind a router."""
from __future__ import annotations

import numpy as np
import pytest

import workers
from two_ranks import two_rank_recipe
from omni.deployment import prepare
from omni.parallel.dp import ReplicaRouter, start_replicas
from omni.parallel.launch import launch
from omni.parallel.mesh import Degrees
from omni.parallel.supervise import WorkerError
from omni.request import ImageRequest
from omni.scheduler_errors import EngineUnavailable, QueueFull, RequestCancelled

PROMPTS = ["a red fox", "a blue boat on a lake", "snow", "a green door"]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The golden tiny weights as an HF-format directory (4x4 tokens, tiny VAE: fast on the CPU)."""
    import json
    from importlib import resources

    import parity
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not parity.golden_available():
        pytest.skip(f"golden data not found in {parity.GOLDEN_DIR}")
    root = tmp_path_factory.mktemp("golden_ckpt")
    meta = json.loads((parity.GOLDEN_DIR / "hunyuan_image3_tiny.json").read_text())
    (root / "config.json").write_text(json.dumps(meta["tiny_config"]))
    with safe_open(str(parity.GOLDEN_TENSORS), framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if not k.startswith("golden.")},
                  str(root / "model.safetensors"))
    tok = resources.files("omni.models.hunyuan_image3.assets").joinpath("tiny_tokenizer.json")
    (root / "tokenizer.json").write_text(tok.read_text())
    return str(root)


def same_image(a, b, where: str) -> None:
    """Equal up to one intensity level (thread counts and batch packing move the last float bits)."""
    diff = np.abs(a.astype(int) - b.astype(int)).max()
    assert a.shape == b.shape and diff <= 1, f"{where}: images differ by {diff} intensity levels"


def requests(n: int):
    return [ImageRequest(prompt=p, steps=3, seed=7 + i, request_id=f"r{i}") for i, p in enumerate(PROMPTS[:n])]


@pytest.fixture(scope="module")
def single(checkpoint):
    """Images of the same requests on one process."""
    from omni.engine import Engine
    from omni.platform_manager import select
    from omni.recipe import load_recipe
    from omni.models.hunyuan_image3.build import build_pipeline

    pipe = build_pipeline(load_recipe("cpu_tiny"), select("cpu"), model_path=checkpoint, progress=False)
    return {r.request_id: r.image_HW3 for r in Engine(pipe).run(requests(4))}


def test_cfg2_replica_serves_in_lock_step(checkpoint, single):
    """Rank 0 runs the Engine over a DriverPipeline; rank 1 replays every call; images match one process. The
    driver knows each rank's own memory: rank 1 touched 512 MiB more before following (CPU: peak RSS)."""
    out = launch(workers.driver_job, Degrees(cfg=2), args=(checkpoint, PROMPTS[:2], 512), timeout_s=120)
    images, follower = out
    assert follower["followed"] > 0
    driver_peak, follower_peak = (m["peak_bytes"] for m in images.pop("_memory_by_rank"))
    assert follower_peak - driver_peak > 256 << 20, (driver_peak, follower_peak)
    assert set(images) == {"r0", "r1", "unseeded"}
    for rid in ("r0", "r1"):
        same_image(images[rid][0], single[rid], rid)
    # no seed: the driver drew one and sent it to both ranks, so both rows saw the same noise
    img, seed = images["unseeded"]
    same_image(img, single_run(checkpoint, ImageRequest(prompt="no seed given", steps=3, seed=seed)), "unseeded")


@pytest.mark.parametrize("degrees", [Degrees(tp=2), Degrees(tp=2, ep=2), Degrees(ulysses=2)],
                         ids=lambda d: d.label())
def test_sharded_replica_built_layer_by_layer_serves_the_single_process_images(checkpoint, single, degrees):
    """build_pipeline on a mesh: meta model cut to each rank's shard, loaded one layer at a time."""
    images, follower = launch(workers.driver_job, degrees, args=(checkpoint, PROMPTS[:2]), timeout_s=120)
    assert follower["followed"] > 0
    for rid in ("r0", "r1"):
        same_image(images[rid][0], single[rid], f"{degrees.label()} {rid}")


def test_a_request_failing_on_every_rank_fails_alone_and_the_replica_serves_on(checkpoint, single):
    """The scheduler's isolation holds across ranks: the poisoned request fails, packed neighbours finish."""
    prompts = [PROMPTS[0], "poison", PROMPTS[1]]
    images, follower = launch(workers.poisoned_driver_job, Degrees(cfg=2),
                              args=(checkpoint, prompts, (0, 1), "denoise_step"), timeout_s=120)
    assert follower["followed"] > 0
    assert images["r1"] == "poisoned request"
    same_image(images["r0"], single["r0"], "r0")
    same_image(images["r2"], single_run(checkpoint, ImageRequest(prompt=PROMPTS[1], steps=3, seed=9)), "r2")


def test_a_failure_on_some_ranks_only_takes_the_replica_down_naming_them(checkpoint):
    """Ranks that disagree on an outcome hold different states: no isolation can hide that.

    (Admission runs no collective. A forward that fails on some ranks only leaves
    the others waiting in its collectives until the distributed timeout ends the job.)
    """
    with pytest.raises(WorkerError) as err:
        launch(workers.poisoned_driver_job, Degrees(cfg=2), args=(checkpoint, [PROMPTS[0], "poison"], (1,), "admit"),
               timeout_s=120)
    assert "LockStepLost: admit failed on replica rank(s) [1] only (ValueError: poisoned request)" in str(err.value)


def single_run(checkpoint, req):
    from omni.engine import Engine
    from omni.platform_manager import select
    from omni.recipe import load_recipe
    from omni.models.hunyuan_image3.build import build_pipeline

    pipe = build_pipeline(load_recipe("cpu_tiny"), select("cpu"), model_path=checkpoint, progress=False)
    return Engine(pipe).run([req])[0].image_HW3


def cancel_over_the_link(router):
    """A long request cancelled through the router ends on its replica with RequestCancelled, not an image."""
    long = router.submit_many([ImageRequest(prompt="snow", steps=100, seed=1, request_id="long")])[0]
    router.cancel(long)
    with pytest.raises(RequestCancelled):
        long.result(timeout=120)


def metric_samples(router) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The server's /metrics text for ``router``, labelled samples only: {metric: {sorted label pairs: value}}."""
    import re

    from omni.serving.metrics import Metrics

    out: dict = {}
    for name, labels, value in re.findall(r"^(\w+)\{([^}]*)\} (\S+)$", Metrics(router).render().decode(), flags=re.M):
        out.setdefault(name, {})[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(value)
    return out


def replica_metrics(router) -> dict[str, dict[str, float]]:
    """Samples labelled by replica alone: {metric: {replica label: value}}."""
    return {name: {dict(k)["replica"]: v for k, v in samples.items() if [n for n, _ in k] == ["replica"]}
            for name, samples in metric_samples(router).items()}


def rank_memory_metrics(router, name: str) -> dict[tuple[str, str], float]:
    """One /metrics memory gauge of a router over multi-rank replicas: {(replica, rank): value}."""
    return {(dict(k)["replica"], dict(k)["rank"]): v for k, v in metric_samples(router)[name].items()}


def test_dp2_router_spreads_requests_over_two_cpu_replicas(checkpoint, single, tmp_path):
    """start_replicas launches a dp=2 recipe; the router gives each replica two of four requests, and a cancel
    reaches the replica that runs the request (it ends with RequestCancelled, not an image). Each replica is
    handed a request to compile ahead (``serving.compile_first``, as ``omni-run generate`` asks): the cpu platform
    has no compile scope, so its warm-up is that pass's no-op, which its ready message still reports."""
    from omni.recipe import load_recipe

    recipe = two_rank_recipe(tmp_path, "dp")
    assert load_recipe(recipe).parallel.dp == 2
    deployment = prepare(str(recipe), platform="cpu", overrides={"model.path": checkpoint,
                                                                 "serving.compile_first": True})
    router = start_replicas(deployment, connect_timeout_s=120, compile_ahead=tuple(requests(1)))
    try:
        router.start()
        assert router.wait_ready(120) and router.status == "ready"
        assert all(r.warm_up_s is not None for r in router.replicas), "the compile-ahead request reached each"
        tickets = [router.submit_many([r])[0] for r in requests(4)]
        owners = [router._owner[id(t)] for t in tickets]
        assert owners.count(router.replicas[0]) == owners.count(router.replicas[1]) == 2  # least-loaded
        for t in tickets:
            same_image(t.result(timeout=120).image_HW3, single[t.request_id], t.request_id)
        metrics = replica_metrics(router)
        assert metrics["omni_scheduler_finished_total"] == {"0": 2.0, "1": 2.0}, "each replica's own count"
        assert all(v > 0 for v in metrics["omni_kv_pages_total"].values())
        assert set(metrics["omni_device_memory_peak_bytes"]) == {"0", "1"}  # the cpu ranks' peak RSS
        cancel_over_the_link(router)
    finally:
        router.stop(60)
    assert not router.job.is_alive() and all(r.status == "stopped" for r in router.replicas)


def test_a_cfg2_replica_warms_up_in_lock_step_then_serves(checkpoint, single, tmp_path):
    """The server's warm-up (start_replicas(..., warm_up=True)) runs through the replica's driver, so both
    ranks run it together; the replica then reports ready, serves the single-process images, and ends a
    request cancelled over the link."""
    recipe = two_rank_recipe(tmp_path, "cfg")
    deployment = prepare(str(recipe), platform="cpu", overrides={"model.path": checkpoint,
                                                                 "serving.warmup_steps": 2})
    router = start_replicas(deployment, connect_timeout_s=120, warm_up=True)
    try:
        router.start()
        assert router.wait_ready(120) and router.status == "ready"
        assert router.replicas[0].warm_up_s > 0, "the replica's ready message says its warm-up ran"
        tickets = [router.submit_many([r])[0] for r in requests(2)]
        for t in tickets:
            same_image(t.result(timeout=120).image_HW3, single[t.request_id], t.request_id)
        peaks = rank_memory_metrics(router, "omni_device_memory_peak_bytes")
        assert set(peaks) == {("0", "0"), ("0", "1")} and all(v > 0 for v in peaks.values()), peaks
        cancel_over_the_link(router)
    finally:
        router.stop(60)
    assert not router.job.is_alive()


def test_a_cfg2_replicas_compile_pass_runs_on_both_ranks_then_it_serves(checkpoint, single):
    """``serving.compile_first`` on a replica: the driver's warm-up enters the compile pass on every rank (the
    followers on its word), both ranks run the warm-up's steps inside it, then again outside, and the replica then
    serves the single-process image."""
    driver, follower = launch(workers.compile_pass_driver_job, Degrees(cfg=2), args=(checkpoint, PROMPTS[0]),
                              timeout_s=120)
    for rank in (driver, follower):
        assert rank["scope"] == (1, 1), "entered and left once on each rank"
        assert rank["steps"] == [True, True, False, False, False, False, False], "2 steps in the pass, 2 + 3 after"
    same_image(driver["image"], single["r0"], "after the compile pass")


def test_replicas_that_fail_to_load_report_why_and_the_router_goes_dead(checkpoint, tmp_path):
    """The first ranks connect before they load, so the server can answer 503 "starting" meanwhile. A load that
    fails (a weights file that is not safetensors, which only reading finds) reaches the router with its reason:
    the router turns dead instead of ready, and its error is the rank's own once the launch has ended."""
    import shutil

    broken = tmp_path / "bad_weights"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(f"{checkpoint}/{name}", broken / name)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    deployment = prepare(str(two_rank_recipe(tmp_path, "dp")), platform="cpu", overrides={"model.path": str(broken)})
    router = start_replicas(deployment, connect_timeout_s=120)
    try:
        router.start()
        assert not router.wait_ready(120) and router.status == "dead"
        assert "SafetensorError" in router.unavailable_reason()
    finally:
        router.stop(60)
    assert not router.job.is_alive()
    assert str(router.error).startswith("rank ") and "failed: SafetensorError: " in str(router.error)


def test_replicas_that_do_not_connect_in_time_are_stopped(checkpoint, tmp_path):
    """Past ``connect_timeout_s`` the launch is cancelled: the error names the timeout and the launch thread
    (with the ranks it started) has ended before start_replicas returns."""
    import threading

    deployment = prepare(str(two_rank_recipe(tmp_path, "dp")), platform="cpu", overrides={"model.path": checkpoint})
    with pytest.raises(RuntimeError, match=r"replicas of cpux2_dp2 did not connect: timeout after 0.2s"):
        start_replicas(deployment, connect_timeout_s=0.2)
    assert not any(t.name == "omni-replicas" and t.is_alive() for t in threading.enumerate())


def test_ranks_that_fail_before_they_connect_stop_the_launch_naming_the_rank(checkpoint, tmp_path, monkeypatch):
    """A rank that fails before its first rank connects (here gloo cannot find the network interface it was
    told to use, so the process group never forms) is found by the listener's wait: the error names the rank
    and its cause at once, not after ``connect_timeout_s``, and the launch has ended."""
    import threading
    import time

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "omni_no_such_if0")  # the ranks inherit it
    deployment = prepare(str(two_rank_recipe(tmp_path, "dp")), platform="cpu", overrides={"model.path": checkpoint})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"replicas of cpux2_dp2 did not connect: rank [01] failed: RuntimeError: "
                                           r".*omni_no_such_if0"):
        start_replicas(deployment, connect_timeout_s=600)
    assert time.monotonic() - t0 < 120, "the failure was found by the wait, not by the timeout"
    assert not any(t.name == "omni-replicas" and t.is_alive() for t in threading.enumerate())


def resources_recipe(name: str) -> str:
    from importlib import resources

    return resources.files("omni.recipes").joinpath(f"{name}.yaml").read_text()


class FakeReplica:
    def __init__(self, load=0, ready=True, full=False):
        self._load, self.ready, self.full, self.got = load, ready, full, []
        self.status, self.error = ("ready" if ready else "starting"), None

    def load(self):
        return self._load

    def figures(self):
        return {"load": self._load}

    def unavailable_reason(self):
        return "loading"

    def submit_many(self, reqs):
        if self.full:
            raise QueueFull("busy", 3)
        self.got += reqs
        import concurrent.futures

        class T:
            future = concurrent.futures.Future()
        return [T() for _ in reqs]


def test_router_prefers_least_loaded_and_skips_full_or_unready():
    a, b, c = FakeReplica(load=5), FakeReplica(load=1, full=True), FakeReplica(load=2)
    router = ReplicaRouter([a, b, c, FakeReplica(ready=False)])
    router.submit_many(requests(2))  # b is least loaded but full: c takes both images together
    assert len(c.got) == 2 and not a.got and not b.got
    with pytest.raises(QueueFull):
        ReplicaRouter([FakeReplica(full=True)]).submit_many(requests(1))
    with pytest.raises(EngineUnavailable, match="replica 0: loading"):
        ReplicaRouter([FakeReplica(ready=False)]).submit_many(requests(1))


def test_router_asks_the_replicas_for_their_figures_at_once():
    """/metrics asks every ready replica together: two replicas whose answers each wait for the other's question
    (a barrier of two) both answer; asked one after the other, the first would wait out the barrier's limit and
    fail. An unready replica is not asked, a failing one is left out of the scrape."""
    import threading

    meet = threading.Barrier(2, timeout=10)

    class Meeting(FakeReplica):
        def figures(self):
            meet.wait()
            return super().figures()

    class Broken(FakeReplica):
        def figures(self):
            raise ConnectionError("link closed")

    router = ReplicaRouter([Meeting(load=1), FakeReplica(ready=False), Broken(), Meeting(load=3)])
    assert router.replica_figures() == [(0, {"load": 1}), (3, {"load": 3})]


def test_the_ray_ingress_reads_a_multi_rank_replicas_figures_through_its_router():
    """A Ray replica of several ranks holds a router over one remote replica: the figures each answer carries
    are that replica's, asked over the link; a replica that does not answer leaves only ``up``."""
    from omni.scheduler_figures import COUNTERS, GAUGES
    from omni.engine_loop import EngineLoop
    from omni.serving.ray_bridge import scheduler_stats

    figures = {"gauges": {name: float(i) for i, name in enumerate(GAUGES)},
               "counters": {key: 10.0 + i for i, key in enumerate(COUNTERS)}, "memory": [],
               "startup": {"build": 3.5, "warm_up": 1.25}}

    class Remote(FakeReplica):
        def figures(self):
            return figures

    class Silent(FakeReplica):
        def figures(self):
            raise TimeoutError("no answer in 5 s")

    got = scheduler_stats(ReplicaRouter([Remote()]))
    assert got == {"up": 1.0, "queue_depth": figures["gauges"]["omni_queue_depth"],
                   "running_requests": figures["gauges"]["omni_running_requests"],
                   "kv_pool_usage_ratio": figures["gauges"]["omni_kv_pool_usage_ratio"],
                   "finished": figures["counters"]["finished"], "steps": figures["counters"]["steps"],
                   "startup_build_seconds": 3.5, "startup_warm_up_seconds": 1.25}
    assert scheduler_stats(ReplicaRouter([Silent()])) == {"up": 1.0}
    assert scheduler_stats(EngineLoop(lambda: None)) == {"up": 0.0}  # one process, not built yet: no scheduler
