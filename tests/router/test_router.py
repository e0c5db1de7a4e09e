"""The router as a real process in front of stand-in engines (no model needed here; the
real-vLLM router tests are in tests/integrations/test_router_vllm.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from kvpool.retention import Hint, TokenRange, as_params, hint_from
from kvpool.router.engines import Engine, attempts
from tests.router.servers import FakeEngine, RouterProc, get_json, post


@pytest.fixture(scope="module")
def fake_pool():
    """Stand-in engines shared by the module's tests: a process start is most of a test's
    time, and a stand-in is reset to new between tests (``fakes``)."""
    pool: list[FakeEngine] = []
    yield pool
    for fake in pool:
        fake.stop()


@pytest.fixture
def fakes(fake_pool):
    """``fakes(n)``: n stand-in engines of the shared pool, each as new (default behaviour,
    empty log); one a test killed is replaced by a new process."""
    handed = 0

    def make(n: int) -> list[FakeEngine]:
        nonlocal handed
        for i in range(handed, handed + n):
            if i == len(fake_pool):
                fake_pool.append(FakeEngine(name=f"e{i}"))
            elif fake_pool[i].proc.poll() is not None:  # killed by an earlier test
                fake_pool[i].stop()
                fake_pool[i] = FakeEngine(name=f"e{i}")
            else:
                fake_pool[i].reset()
        handed += n
        return fake_pool[handed - n : handed]

    return make


@pytest.fixture
def routers(tmp_path):
    started: list[RouterProc] = []

    def make(
        engines: list[str],
        *args: str,
        env: dict[str, str] | None = None,
        health_interval: float | None = None,
    ) -> RouterProc:
        """``health_interval``: check the engines this often (the settings file's
        ``health_interval``; 1 s by default), for a test that waits on their checks."""
        if health_interval is not None:
            settings = tmp_path / f"router-{len(started)}.toml"
            settings.write_text(f"health_interval = {health_interval}\n")
            args = (*args, "--config", str(settings))
        router = RouterProc(engines, *args, env=env)
        started.append(router)
        return router

    yield make
    for router in started:
        router.stop()


def engine_state(router: RouterProc, url: str) -> dict:
    """The router's account of one engine (``GET /admin/engines``)."""
    engines = get_json(router.url + "/admin/engines")["engines"]
    return next(e for e in engines if e["url"] == url)


def wait_engine(router: RouterProc, url: str, until, what: str, timeout: float = 30) -> dict:
    """The engine's state once ``until(state)`` holds, polled every 20 ms."""
    deadline = time.monotonic() + timeout
    while not until(state := engine_state(router, url)):
        assert time.monotonic() < deadline, f"{what}: {state}"
        time.sleep(0.02)
    return state


def wait_logged(router: RouterProc, *texts: str, timeout: float = 10) -> list[str]:
    """The router's output lines holding one of ``texts``, once there is one."""
    deadline = time.monotonic() + timeout
    while not (lines := [line for line in router.output if any(t in line for t in texts)]):
        assert time.monotonic() < deadline, f"the router never logged any of {texts}"
        time.sleep(0.02)
    return lines


def complete(
    router: RouterProc, body: dict | None = None, headers: dict | None = None, chat: bool = False
):
    route = "/v1/chat/completions" if chat else "/v1/completions"
    payload = body or {"model": "m", "prompt": "hello", "max_tokens": 4}
    request = urllib.request.Request(
        router.url + route,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.headers.get("x-kvpool-engine"), response.read().decode()


def test_round_robin_and_non_streaming_answers(fakes, routers):
    a, b = fakes(2)
    router = routers([a.url, b.url], "--policy", "round_robin")
    served = [complete(router)[0] for _ in range(6)]
    assert served.count(a.url) == 3 and served.count(b.url) == 3
    _, text = complete(
        router, chat=True, body={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert json.loads(text)["choices"][0]["message"]["content"]
    assert get_json(router.url + "/v1/models")["data"][0]["id"] == "m"
    assert get_json(router.url + "/health")["healthy"]
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvpool_router_requests_total{route="/v1/completions",status="200"} 6.0' in metrics


def test_streaming_is_passed_through_chunk_by_chunk(fakes, routers):
    (a,) = fakes(1)
    a.configure(chunks=5, delay=0.3)
    router = routers([a.url])

    async def stream():
        arrivals = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                router.url + "/v1/completions",
                json={"model": "m", "prompt": "p", "max_tokens": 5, "stream": True},
            ) as response,
        ):
            assert response.headers["Content-Type"].startswith("text/event-stream")
            start = time.monotonic()
            async for chunk in response.content.iter_any():
                arrivals.append((time.monotonic() - start, chunk))
        return arrivals

    arrivals = asyncio.run(stream())
    body = b"".join(c for _, c in arrivals).decode()
    assert body.count("data: ") == 6 and body.rstrip().endswith("data: [DONE]")
    assert (
        arrivals[0][0] < 0.2 and arrivals[-1][0] > 1.0
    )  # the first chunk did not wait for the last


def test_least_load_uses_the_engines_metrics(fakes, routers):
    a, b = fakes(2)
    a.configure(running=8, waiting=4)
    router = routers([a.url, b.url], "--policy", "least_load")
    loaded = lambda e: (e["running"], e["waiting"]) == (8, 4)  # noqa: E731
    wait_engine(router, a.url, loaded, "no metrics scrape read a's load")
    assert {complete(router)[0] for _ in range(5)} == {b.url}


def test_session_affinity_by_header_and_user(fakes, routers):
    engines = fakes(3)
    router = routers([e.url for e in engines], "--policy", "session")
    for session in ("alice", "bob", "carol", "dave"):
        served = {complete(router, headers={"X-Session-Id": session})[0] for _ in range(3)}
        assert len(served) == 1
        by_user = {
            complete(router, body={"model": "m", "prompt": "x", "user": session})[0]
            for _ in range(3)
        }
        assert by_user == served


def test_unhealthy_and_killed_engines_are_skipped_and_taken_back(fakes, routers):
    a, b = fakes(2)
    router = routers([a.url, b.url], "--policy", "round_robin", health_interval=0.1)
    b.configure(healthy=False)
    wait_engine(router, b.url, lambda e: not e["healthy"], "a failed check left b in")
    assert {complete(router)[0] for _ in range(4)} == {a.url}
    b.configure(healthy=True)
    back = wait_engine(router, b.url, lambda e: e["healthy"], "b was never taken back")
    assert back["successes"] >= 2  # two successful checks
    assert b.url in {complete(router)[0] for _ in range(4)}
    a.kill()
    results = [complete(router)[0] for _ in range(6)]  # the first may hit dead a: retried on b
    assert set(results) == {b.url}


def test_a_slow_health_check_leaves_the_engine_in_and_a_run_of_them_takes_it_out(fakes, routers):
    """A busy engine answers its health checks late (the router waits 2 s for each): it
    stays in rotation until three checks in a row have timed out."""
    a, b = fakes(2)
    router = routers([a.url, b.url], "--policy", "round_robin", health_interval=0.1)
    a.configure(health_delay=3)
    two = wait_engine(router, a.url, lambda e: e["slow_checks_in_a_row"] >= 2, "no slow check")
    assert two["slow_checks_in_a_row"] == 2 and two["healthy"]  # the third takes 2 s more
    assert {complete(router)[0] for _ in range(4)} == {a.url, b.url}
    out = wait_engine(
        router, a.url, lambda e: not e["healthy"], "three timed-out checks left a in rotation", 60
    )
    assert out["slow_checks_in_a_row"] >= 3
    assert {complete(router)[0] for _ in range(4)} == {b.url}


def test_a_retry_goes_to_an_engine_taken_back_meanwhile():
    a, b = Engine("http://a"), Engine("http://b", is_healthy=False)
    tries = attempts([a], lambda: [e for e in (a, b) if e.is_available], 3)
    assert next(tries) is a  # b was out when the request was ranked
    a.is_healthy, b.is_healthy = False, True  # a failed it; b's checks took it back
    assert list(tries) == [b]
    only = Engine("http://only")
    assert list(attempts([only], lambda: [only], 3)) == [only] * 3  # it may be restarting
    x, y = Engine("http://x"), Engine("http://y")
    assert list(attempts([x, y], lambda: [x, y], 3)) == [x, y]  # each once


def test_failures_before_the_first_byte_are_retried(fakes, routers):
    a, b = fakes(2)
    a.configure(fail=100)
    router = routers([a.url, b.url], "--policy", "round_robin")
    assert all(complete(router)[0] == b.url for _ in range(4))
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as response:
        assert 'kvpool_router_retries_total{phase="decode"}' in response.read().decode()


def test_a_stream_that_dies_before_its_first_chunk_is_retried(fakes, routers):
    # vLLM sends a stream's headers at once; an engine that dies during the prefill leaves
    # no chunk: the router must not have answered yet, and retries elsewhere.
    a, b = fakes(2)
    a.configure(drop=100)
    router = routers([a.url, b.url], "--policy", "round_robin")
    for _ in range(4):
        engine, body = complete(
            router, {"model": "m", "prompt": "p", "max_tokens": 5, "stream": True}
        )
        assert engine == b.url and body.rstrip().endswith("data: [DONE]")
    a.configure(drop=0)
    wait_engine(router, a.url, lambda e: e["healthy"], "a was not taken back after its checks")
    assert {complete(router)[0] for _ in range(4)} == {a.url, b.url}
    # A 500 is retried too, but one bad answer does not take an engine out of rotation.
    b.configure(fail=1)
    assert [complete(router)[0] for _ in range(2)] == [a.url, a.url]  # b's 500: retried on a
    assert engine_state(router, b.url)["healthy"]  # still in (taking it back takes two checks)
    assert {complete(router)[0] for _ in range(4)} == {a.url, b.url}  # no health check since


def test_a_silent_engine_is_given_up_on_and_the_request_retried(fakes, routers):
    a, b = fakes(2)
    a.configure(hang=True)
    router = routers([a.url, b.url], "--policy", "round_robin", "--read-timeout", "1")
    started = time.monotonic()
    assert {complete(router)[0] for _ in range(3)} == {b.url}
    assert time.monotonic() - started < 10


def test_prefill_decode_disaggregation(fakes, routers):
    p1, p2, d = fakes(3)
    router = routers([f"{p1.url},role=prefill", f"{p2.url},role=prefill", f"{d.url},role=decode"])
    body = {
        "model": "m",
        "prompt": "long prompt",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"x": 1},
        # A retention hint (kvpool.retention) travels to both engines' connectors.
        "kv_transfer_params": as_params(Hint((TokenRange(0, 512, 90, 60.0),), "chat-1")),
    }
    engine, text = complete(router, body=body)
    assert engine == d.url and text.count("data: ") == 6  # 5 chunks and [DONE]
    prefills = p1.log() + p2.log()
    assert len(prefills) == 1
    sent = prefills[0]["body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    assert sent["prompt"] == "long prompt"
    assert hint_from(sent["kv_transfer_params"]) == hint_from(body["kv_transfer_params"])
    assert d.log()[0]["body"] == body  # decode gets the request unchanged
    # A failing prefill is retried on the other prefill engine ...
    p1.configure(fail=1)
    p2.configure(fail=1)
    complete(router, body=body)
    assert sum(len(p.log()) for p in (p1, p2)) == 3
    # ... and when every prefill fails, decode serves alone, with a warning.
    p1.configure(fail=100)
    p2.configure(fail=100)
    engine, text = complete(router, body=body)
    assert engine == d.url and "[DONE]" in text
    assert wait_logged(router, "falling back", "decode alone")


def test_one_prefill_and_one_decode_ride_out_single_failures(fakes, routers):
    # The guide's 1P1D layout: each role has one engine, so a failure cannot go elsewhere.
    # The router retries the same engine after a short backoff, and never takes the last
    # engine of a role out of rotation on one failure.
    p, d = fakes(2)
    router = routers([f"{p.url},role=prefill", f"{d.url},role=decode"])
    body = {"model": "m", "prompt": "pd", "max_tokens": 3, "stream": True}
    d.configure(fail=1)  # a decode 500, once
    engine, text = complete(router, body=body)
    assert engine == d.url and "[DONE]" in text
    assert sum(1 for e in d.log() if e["body"] == body) == 2  # the same engine, twice
    d.configure(drop=1)  # a decode stream dropped before its first byte, once
    started = time.monotonic()
    engine, text = complete(router, body=body)
    assert engine == d.url and "[DONE]" in text
    for _ in range(5):  # and the only decoder stayed in rotation: no 503 in between
        engine, text = complete(router, body=body)
        assert engine == d.url and "[DONE]" in text
    assert time.monotonic() - started < 5
    p.configure(fail=1)  # a prefill 500, once: retried on the same prefill engine
    before = len(p.log())
    engine, text = complete(router, body=body)
    assert engine == d.url and len(p.log()) == before + 2
    assert not any("decode alone" in line for line in router.output)
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvpool_router_retries_total{phase="decode"} 2.0' in metrics
    assert 'kvpool_router_retries_total{phase="prefill"} 1.0' in metrics
    # A decoder that is really gone goes out after a few failures in a row.
    d.kill()
    with pytest.raises(urllib.error.HTTPError) as failed:
        complete(router, body=body)
    assert failed.value.code == 502
    failed.value.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and get_json_status(router.url + "/health") == 200:
        time.sleep(0.02)
    assert get_json_status(router.url + "/health") == 503


def get_json_status(url: str) -> int:
    return status_of(urllib.request.Request(url))


def status_of(request: urllib.request.Request) -> int:
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_routing_decisions_are_explained(fakes, routers):
    a, b = fakes(2)
    a.configure(running=3)
    router = routers([a.url, b.url], "--policy", "least_load", "--log-level", "debug")
    wait_engine(router, a.url, lambda e: e["running"] == 3, "no health check read a's load")
    request = urllib.request.Request(
        router.url + "/v1/completions",
        data=json.dumps({"model": "m", "prompt": "why", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["x-kvpool-engine"] == b.url
        assert response.headers["x-kvpool-route"] == "policy=least_load; load=0"
    decisions = wait_logged(router, "route /v1/completions to")
    assert decisions and b.url in decisions[-1] and "load=3" in decisions[-1]


def test_a_client_that_disconnects_cancels_the_upstream_request(fakes, routers):
    (a,) = fakes(1)
    a.configure(chunks=100, delay=0.2)
    router = routers([a.url])

    async def go():
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                router.url + "/v1/completions",
                json={"model": "m", "prompt": "p", "stream": True, "max_tokens": 100},
            )
            await response.content.readany()
            response.close()  # the client goes away mid-stream

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not a.log()[-1]["cancelled"]:
        time.sleep(0.02)
    entry = a.log()[-1]
    assert entry["cancelled"] and not entry["done"]


def test_engines_added_and_removed_at_run_time_with_drain(fakes, routers):
    a, b = fakes(2)
    router = routers([a.url], "--policy", "round_robin")
    added = post(router.url + "/admin/engines", {"url": b.url, "role": "both"})
    assert added["url"] == b.url
    assert {complete(router)[0] for _ in range(4)} == {a.url, b.url}
    # Removing b while it serves a slow request: the request completes, then b goes.
    b.configure(chunks=5, delay=0.3)
    a.configure(chunks=5, delay=0.3)
    results = []

    def slow():
        results.append(
            complete(router, body={"model": "m", "prompt": "s", "stream": True, "max_tokens": 5})
        )

    threads = [threading.Thread(target=slow) for _ in range(2)]  # one on each engine
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not all(any(e["body"]["prompt"] == "s" for e in f.log()) for f in (a, b)):
        assert time.monotonic() < deadline, "the slow requests never reached both engines"
        time.sleep(0.02)
    started = time.monotonic()
    removed = post(f"{router.url}/admin/engines?url={b.url}", {}, method="DELETE")
    assert removed["drained"] and time.monotonic() - started > 0.5
    for t in threads:
        t.join(10)
    assert len(results) == 2 and all("[DONE]" in text for _, text in results)
    engines = get_json(router.url + "/admin/engines")["engines"]
    assert [e["url"] for e in engines] == [a.url]
    assert {complete(router)[0] for _ in range(3)} == {a.url}


def test_bad_requests_are_refused_clearly(fakes, routers):
    (a,) = fakes(1)
    router = routers([a.url])
    request = urllib.request.Request(
        router.url + "/v1/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert error.value.code == 400
    error.value.close()
    with pytest.raises(urllib.error.HTTPError) as error:
        post(router.url + "/admin/engines", {"url": "ftp://nope", "role": "sideways"})
    assert error.value.code == 400
    error.value.close()


def test_with_tenants_only_the_cluster_may_steer_the_router(fakes, routers, tmp_path):
    """From the attacker's side: an engine added through /admin/engines would receive every
    tenant's prompts, so with --tenants only the cluster's credential may list, add or
    remove engines or read /metrics; a tenant's is refused, no credential asks for one, and
    a cross-site text/plain POST (what a web page can send without a preflight) is refused
    even with the right credential."""
    from base64 import b64encode

    from tests.security.tenants import CLUSTER, TenantsFile

    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha = tenants.add("alpha")[0]
    tenants.write()
    (a,) = fakes(1)
    router = routers(
        [f"{a.url},tenants=alpha"],
        "--tenants",
        str(tenants.path),
        env={"KVPOOL_ACCESS_ID": CLUSTER[0], "KVPOOL_ACCESS_KEY": CLUSTER[1]},
    )

    def call(path, credential=None, method="GET", body=None, content_type="application/json"):
        headers = {"Content-Type": content_type}
        if credential is not None:
            token = b64encode(f"{credential[0]}:{credential[1]}".encode()).decode()
            headers["Authorization"] = "Basic " + token
        data = None if body is None else body.encode()
        return status_of(urllib.request.Request(router.url + path, data, headers, method=method))

    evil = json.dumps({"url": "http://127.0.0.1:9", "role": "both", "tenants": ["alpha"]})
    for path, method, body in (
        ("/admin/engines", "GET", None),
        ("/admin/engines", "POST", evil),
        (f"/admin/engines?url={a.url}", "DELETE", None),
        ("/metrics", "GET", None),
    ):
        assert call(path, None, method, body) == 401, (path, method)
        assert call(path, (CLUSTER[0], "not-the-key"), method, body) == 401, (path, method)
        assert call(path, alpha, method, body) == 403, (path, method)
    assert call("/admin/engines", CLUSTER, "POST", evil, content_type="text/plain") == 415
    assert [e["url"] for e in get_engines(router, CLUSTER)] == [a.url]  # nothing changed
    assert call("/metrics", CLUSTER) == 200
    assert call("/health") == 200  # probes stay open
    assert call("/admin/engines", CLUSTER, "POST", evil) == 201  # the operator may


def get_engines(router, credential):
    from base64 import b64encode

    token = b64encode(f"{credential[0]}:{credential[1]}".encode()).decode()
    request = urllib.request.Request(
        router.url + "/admin/engines", headers={"Authorization": "Basic " + token}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["engines"]
