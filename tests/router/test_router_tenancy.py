"""From a tenant's side, against a real router in front of real (stand-in) engines: a
tenant's requests reach only the engines that serve it, and no engine serves two tenants.

An engine saves and loads the pool under the one credential its connector holds, and vLLM's
GPU prefix cache is shared by every request it runs: a request of tenant beta on alpha's
engine would read alpha's KV (and time alpha's prompts).  (Issue 28, item 6.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from base64 import b64encode

import pytest

from tests.router.servers import FakeEngine, RouterProc
from tests.security.tenants import CLUSTER, TenantsFile

CLUSTER_ENV = {"KVPOOL_ACCESS_ID": CLUSTER[0], "KVPOOL_ACCESS_KEY": CLUSTER[1]}


@pytest.fixture
def started():
    """Processes the test starts, stopped at its end."""
    procs: list[FakeEngine | RouterProc] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture
def tenants(tmp_path):
    file = TenantsFile(tmp_path / "tenants.toml")
    credentials = {name: file.add(name)[0] for name in ("alpha", "beta", "gamma")}
    file.write()
    return file, credentials


def engine(started: list, name: str) -> FakeEngine:
    fake = FakeEngine(name)
    started.append(fake)
    return fake


def router(started: list, engines: list[str], *args: str) -> RouterProc:
    proc = RouterProc(engines, *args, env=CLUSTER_ENV)
    started.append(proc)
    return proc


def call(
    url: str, credential: tuple[str, str] | None, body: object, method: str = "POST"
) -> tuple[int, dict, dict]:
    """Status, JSON body and headers of one request (``credential`` as HTTP Basic)."""
    headers = {"Content-Type": "application/json"}
    if credential is not None:
        token = b64encode(f"{credential[0]}:{credential[1]}".encode()).decode()
        headers["Authorization"] = "Basic " + token
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def complete(proc: RouterProc, credential: tuple[str, str]) -> tuple[int, dict, dict]:
    body = {"model": "m", "prompt": "a tenant's private prompt", "max_tokens": 2}
    return call(proc.url + "/v1/completions", credential, body)


def run_router(*args: str) -> tuple[int, str]:
    """A router that should refuse to start: its exit status and what it said (on one line:
    the console wraps long messages)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "router", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **CLUSTER_ENV},
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def prompts_seen(fake: FakeEngine) -> int:
    return sum(1 for entry in fake.log() if entry["path"].endswith("/completions"))


def test_a_tenants_requests_reach_only_its_own_engines(started, tenants):
    file, credentials = tenants
    alpha_1, alpha_2, beta_1 = (engine(started, n) for n in ("alpha-1", "alpha-2", "beta-1"))
    proc = router(
        started,
        [
            f"{alpha_1.url},tenants=alpha",
            f"{alpha_2.url},tenants=alpha",
            f"{beta_1.url},tenants=beta",
        ],
        "--policy",
        "round_robin",
        "--tenants",
        str(file.path),
    )
    # Beta, many times over: round robin over every engine would send it to alpha's.
    for _ in range(6):
        status, _, headers = complete(proc, credentials["beta"])
        assert status == 200 and headers["x-kvpool-engine"] == beta_1.url
    assert prompts_seen(alpha_1) == prompts_seen(alpha_2) == 0
    served = {complete(proc, credentials["alpha"])[2]["x-kvpool-engine"] for _ in range(4)}
    assert served == {alpha_1.url, alpha_2.url}
    assert prompts_seen(beta_1) == 6

    # Gamma has no engine: refused, and no engine saw its prompt.
    status, body, _ = complete(proc, credentials["gamma"])
    assert status == 403 and "no engine serves tenant 'gamma'" in body["error"]["message"]
    # The cluster's credential steers the router; it is no tenant, and no engine is its.
    assert complete(proc, CLUSTER)[0] == 403
    assert prompts_seen(alpha_1) + prompts_seen(alpha_2) + prompts_seen(beta_1) == 10

    # With beta's only engine unhealthy, beta waits for it: alpha's engines stay alpha's.
    beta_1.configure(fail=10)
    status, _, _ = complete(proc, credentials["beta"])
    assert status == 502
    assert prompts_seen(alpha_1) + prompts_seen(alpha_2) == 4

    # An engine the operator adds for gamma takes gamma's requests, and only those.
    gamma_1 = engine(started, "gamma-1")
    status, body, _ = call(
        proc.url + "/admin/engines", CLUSTER, {"url": gamma_1.url, "tenants": ["gamma"]}
    )
    assert status == 201 and body["tenants"] == ["gamma"]
    assert complete(proc, credentials["gamma"])[2]["x-kvpool-engine"] == gamma_1.url
    assert prompts_seen(gamma_1) == 1


def test_a_tenants_prefill_never_runs_on_another_tenants_prefill_engine(started, tenants):
    """Alpha disaggregates (prefill + decode); beta has one plain engine.  Beta's prompt must
    not be prefilled on alpha's prefill engine, which would save it under alpha's credential."""
    file, credentials = tenants
    prefill, decode, beta_1 = (engine(started, n) for n in ("prefill", "decode", "beta-1"))
    proc = router(
        started,
        [
            f"{prefill.url},role=prefill,tenants=alpha",
            f"{decode.url},role=decode,tenants=alpha",
            f"{beta_1.url},tenants=beta",
        ],
        "--tenants",
        str(file.path),
    )
    status, _, headers = complete(proc, credentials["beta"])
    assert status == 200 and headers["x-kvpool-engine"] == beta_1.url
    assert prompts_seen(prefill) == prompts_seen(decode) == 0
    assert prompts_seen(beta_1) == 1  # one plain request: no prefill step of its own
    status, _, headers = complete(proc, credentials["alpha"])
    assert status == 200 and headers["x-kvpool-engine"] == decode.url
    assert prompts_seen(prefill) == 1


def test_an_engine_shared_by_tenants_is_refused(started, tenants, tmp_path):
    """kvpool's connector holds one pool credential per engine (none per request), so under
    --tenants an engine serves exactly one tenant, at start and when added at run time."""
    file, credentials = tenants
    alpha_1, spare = engine(started, "alpha-1"), engine(started, "spare")

    def start(*engines: str) -> tuple[int, str]:
        command = ["--tenants", str(file.path)]
        for spec in engines:
            command += ["--engine", spec]
        return run_router(*command)

    status, output = start(f"{alpha_1.url},tenants=alpha+beta")
    assert status == 2 and "serves exactly one tenant" in output, output
    status, output = start(alpha_1.url)
    assert status == 2 and "serves exactly one tenant" in output, output
    status, output = start(f"{alpha_1.url},tenants=delta")
    assert status == 2 and "no tenant 'delta'" in output, output

    proc = router(started, [f"{alpha_1.url},tenants=alpha"], "--tenants", str(file.path))
    admin = proc.url + "/admin/engines"
    for spec in (
        {"url": spare.url, "tenants": ["alpha", "beta"]},
        {"url": spare.url},
        {"url": spare.url, "tenants": ["delta"]},
        {"url": spare.url, "tenants": "alpha", "role": "both", "extra": 1},
    ):
        status, body, _ = call(admin, CLUSTER, spec)
        assert status == 400 and body["error"], spec
    status, body, _ = call(admin, CLUSTER, None, method="GET")
    assert [e["url"] for e in body["engines"]] == [alpha_1.url]
    # Beta still has no engine: its prompt reached neither.
    assert complete(proc, credentials["beta"])[0] == 403
    assert prompts_seen(alpha_1) == prompts_seen(spare) == 0


def test_without_tenants_an_engine_takes_no_tenant_set(started):
    """Without a tenants file no request names a tenant: a tenant set would be ignored, so
    it is refused instead of giving the look of isolation."""
    alpha_1 = engine(started, "alpha-1")
    status, output = run_router("--engine", f"{alpha_1.url},tenants=alpha")
    assert status == 2 and "tenants need the router's --tenants file" in output, output


def test_a_tenants_last_engine_is_kept_whatever_other_tenants_have(started, tenants):
    """The last engine of a role stays in rotation through a dropped connection (it is
    retried): with tenants, "last" is counted among its tenant's engines, since another
    tenant's engine can never take the request."""
    file, credentials = tenants
    alpha_1, beta_1 = engine(started, "alpha-1"), engine(started, "beta-1")
    proc = router(
        started,
        [f"{alpha_1.url},tenants=alpha", f"{beta_1.url},tenants=beta"],
        "--tenants",
        str(file.path),
    )
    alpha_1.configure(drop=1)  # its next stream dies before the first chunk
    token = b64encode(":".join(credentials["alpha"]).encode()).decode()
    request = urllib.request.Request(
        proc.url + "/v1/completions",
        json.dumps({"model": "m", "prompt": "p", "max_tokens": 2, "stream": True}).encode(),
        {"Content-Type": "application/json", "Authorization": "Basic " + token},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200 and b"[DONE]" in response.read()
        assert response.headers["x-kvpool-engine"] == alpha_1.url
        assert "attempt=2" in response.headers["x-kvpool-route"]
    # Still in rotation (beta's engine does not count as a spare of alpha's), so alpha's
    # next request is served at once instead of finding no healthy engine.
    status, body, _ = call(proc.url + "/admin/engines", CLUSTER, None, method="GET")
    assert status == 200
    assert {e["url"]: e["healthy"] for e in body["engines"]}[alpha_1.url] is True
    assert complete(proc, credentials["alpha"])[0] == 200
    assert prompts_seen(beta_1) == 0
