"""The guide's deployment on the MLA model (DeepSeek-V3's shape, Kimi-K2.5's family): one
prefill engine (``kv_producer``) and one decode engine (``kv_consumer``) through kvpool's
router, with the guide's engine flags (``--no-enable-prefix-caching``,
``--disable-hybrid-kv-cache-manager``)."""

from __future__ import annotations

import pytest

from kvpool.integrations.vllm.backends import DECLINED_LOG
from tests.integrations.mla import PROMPTS, SERVER_ARGS, full_blocks
from tests.integrations.test_router_vllm import complete
from tests.integrations.vllm_server import VllmServer, connector_config
from tests.router.servers import RouterProc

pytestmark = [pytest.mark.vllm]


def test_prefill_decode_on_the_mla_model(mla_model, mla_reference, start_node):
    """The decode engine loads each prompt's latent KV that the prefill engine saved, and
    answers exactly as one engine doing it all answers from its own prefix cache, asked one
    request at a time (``again`` in tests/integrations/mla.py: for the first prompt that
    differs from the engine's fresh answer, for the second it is the same).  Where vLLM runs
    its reference MLA kernels, kvpool loads nothing into the decode engine: it answers as
    fresh."""
    node = start_node(name="mla-pd", memory="256MiB")
    servers: list[VllmServer] = []
    router = None
    try:
        for role in ("kv_producer", "kv_consumer"):
            config = connector_config(node.unix_address, role)
            servers.append(
                VllmServer(mla_model, kv_transfer_config=config, engine_args=SERVER_ARGS)
            )
        prefill, decode = servers
        router = RouterProc([f"{prefill.url},role=prefill", f"{decode.url},role=decode"])
        answers = []
        for prompt in PROMPTS:
            served_by, text = complete(router.url, mla_model, prompt)
            assert served_by == decode.url
            answers.append(text)
        assert answers == mla_reference["again_texts"], mla_reference
        hits = decode.metric("vllm:external_prefix_cache_hits_total")
        if mla_reference["declined"]:
            # vLLM's reference MLA kernels here: nothing is loaded, and the log says why.
            assert hits == 0
            assert DECLINED_LOG in "".join(decode.log)
        else:
            assert hits >= 0.9 * full_blocks(mla_reference["prompt_tokens"])
        assert prefill.metric("vllm:external_prefix_cache_hits_total") == 0
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
