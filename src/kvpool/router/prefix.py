"""Where a request's prompt prefix is cached: the cache-aware policy's eyes.

The router tokenizes a request as vLLM will (the model's own tokenizer and chat template),
hashes its full blocks with vLLM's own block-hash function and seed, and asks each engine's
pool node how long a prefix of those blocks it holds.  Keys are ``namespace id + block
hash``; the namespaces are read from the nodes (the connector labels them with the model),
so the router needs no copy of the engines' configuration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.client import Client
from kvpool.cluster.cooldown import Cooldowns
from kvpool.config import ClientConfig
from kvpool.errors import ConfigError, PoolTimeout
from kvpool.keys import NAMESPACE_ID_BYTES, block_key
from kvpool.limits import ROUTER_MAX_SLOW_ANSWERS, ROUTER_NODE_DOWN_S
from kvpool.tenants import Tenant

log = logging.getLogger("kvpool.router")

NAMESPACE_REFRESH_S = 5.0
NAMESPACE_RETRY_S = 0.2
LOOKUP_THREADS = 8


class PromptHasher:
    """Token ids and vLLM block hashes of a completions or chat request."""

    def __init__(self, tokenizer_path: str, block_size: int, hash_algo: str = "sha256"):
        from transformers import AutoTokenizer

        try:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
        except ImportError as exc:  # pragma: no cover - vllm is a dependency of the extra
            raise RuntimeError(
                "cache-aware routing hashes blocks with vLLM's own code: install vllm"
            ) from exc
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as exc:  # not on the hub, not in the cache, offline
            raise ConfigError(
                f"cannot load the tokenizer {tokenizer_path!r} (router config `tokenizer`): "
                f"{exc}; a local directory, or a model hub name reachable or in HF_HOME's cache"
            ) from exc
        self.block_size = block_size
        self._hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self._hash_fn)
        self._hash_block_tokens = hash_block_tokens

    def token_ids(self, route: str, body: dict[str, Any]) -> list[int]:
        if route.endswith("/chat/completions"):
            text = self.tokenizer.apply_chat_template(
                body.get("messages", []), tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        return list(self.tokenizer(str(prompt))["input_ids"])

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        hashes: list[bytes] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self._hash_block_tokens(
                self._hash_fn, parent, token_ids[start : start + bs], None
            )
            hashes.append(bytes(parent))
        return hashes


@dataclass
class Located:
    """A prompt's number of full blocks, the prefix (in blocks) each node holds, and why a
    node counts as holding nothing without having said so."""

    num_blocks: int = 0
    hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    prefix_by_node: dict[str, int] = field(default_factory=dict)
    unanswered: dict[str, str] = field(default_factory=dict)


class PrefixLocator:
    """How many leading blocks of a prompt each pool node holds."""

    def __init__(self, hasher: PromptHasher, client_config: ClientConfig, model: str = ""):
        self.hasher = hasher
        self.client_config = client_config
        self.model = model
        self._clients: dict[str, Client] = {}
        self._namespaces: dict[str, tuple[float, list[bytes]]] = {}
        # A node that cannot be reached is left alone for a moment; a slow one (a busy
        # host) only after several slow answers in a row.
        self._down = Cooldowns(ROUTER_NODE_DOWN_S, max_slow=ROUTER_MAX_SLOW_ANSWERS)
        # Its own threads: a slow node must not take the event loop's default executor.
        self._executor = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvpool-locate")

    def _client(self, node: str) -> Client:
        client = self._clients.get(node)
        if client is None:
            config = self.client_config.replace(address=node, peers=(), etcd="")
            client = self._clients[node] = Client(config=config)
        return client

    def _namespace_ids(self, node: str, deadline: float) -> list[bytes]:
        """The node's namespaces of the model.  Kept for a while once known; while a node
        has none (no engine has saved there yet, as right after start), asked again soon:
        keeping "none" as long made every request in that window a miss everywhere."""
        cached = self._namespaces.get(node)
        if cached is not None:
            since, ids = cached
            if time.monotonic() - since < (NAMESPACE_REFRESH_S if ids else NAMESPACE_RETRY_S):
                return ids
        stats = self._client(node).stats(timeout=_left(deadline))
        ids = [
            bytes.fromhex(ns.namespace_id)
            for ns in stats.namespaces
            if ns.label and (not self.model or ns.label.startswith(self.model))
        ]
        ids = [i for i in ids if len(i) == NAMESPACE_ID_BYTES]
        self._namespaces[node] = (time.monotonic(), ids)
        return ids

    def _prefix_on(
        self, node: str, hashes: list[bytes], deadline: float, tenant: Tenant | None = None
    ) -> int:
        best = 0
        client = self._client(node)
        for namespace_id in _theirs(self._namespace_ids(node, deadline), tenant):
            keys = [block_key(namespace_id, h) for h in hashes]
            best = max(best, client.lookup(keys, timeout=_left(deadline)))
        return best

    async def locate(
        self,
        route: str,
        body: dict[str, Any],
        nodes: Sequence[str],
        tenant: Tenant | None = None,
    ) -> Located:
        """The prompt's number of full blocks, and the prefix (in blocks) each node holds
        (of ``tenant``'s namespaces only, for a tenant's request).  A node that cannot be
        asked in time holds nothing (and is left alone for a moment); the whole answer
        takes at most the client timeout."""
        loop = asyncio.get_running_loop()
        located = Located()
        try:
            token_ids = await loop.run_in_executor(
                self._executor, self.hasher.token_ids, route, body
            )
        except Exception as exc:  # a body vLLM would refuse: it gets the error from vLLM
            log.debug("cannot tokenize the request: %s", exc)
            return located
        hashes = self.hasher.block_hashes(token_ids)
        located.num_blocks = len(hashes)
        located.hashes = hashes
        if not hashes:
            return located
        deadline = time.monotonic() + self.client_config.timeout_s
        now = time.monotonic()
        asked = []
        for node in sorted(set(nodes)):
            if node and self._down.is_down(node, now):
                located.unanswered[node] = "skipped: did not answer lately"
            elif node:
                asked.append(node)
        tasks = {
            node: loop.run_in_executor(
                self._executor, self._prefix_on, node, hashes, deadline, tenant
            )
            for node in asked
        }
        if tasks:
            await asyncio.wait(tasks.values(), timeout=_left(deadline))
        for node, task in tasks.items():
            located.prefix_by_node[node] = 0
            if task.done() and task.exception() is None:
                located.prefix_by_node[node] = task.result()
                self._down.answered(node)
                continue
            if not task.done():
                task.add_done_callback(_consume)  # it ends at its own deadline
            error = task.exception() if task.done() else None
            if error is None or isinstance(error, PoolTimeout):
                self._down.slow(node)
            else:
                self._down.failed(node)
            located.unanswered[node] = f"no answer: {error or 'not in time'}"
            log.info("prefix lookup on %s: %s", node, error or "no answer in time")
        return located

    async def prefetch(
        self,
        route: str,
        body: dict[str, Any],
        node: str,
        hold_s: float,
        hashes: list[bytes] | None = None,
        tenant: Tenant | None = None,
    ) -> None:
        """Ask ``node`` to bring the prompt's blocks into DRAM and hold them ``hold_s`` for
        the request.  Best effort: a node that does not answer in time is skipped."""
        loop = asyncio.get_running_loop()
        try:
            if hashes is None:
                token_ids = await loop.run_in_executor(
                    self._executor, self.hasher.token_ids, route, body
                )
                hashes = self.hasher.block_hashes(token_ids)
            if hashes:
                await loop.run_in_executor(
                    self._executor, self._prefetch_on, node, hashes, hold_s, tenant
                )
        except Exception as exc:  # a hint: nothing depends on it
            log.debug("prefetch on %s: %s", node, exc)

    def _prefetch_on(
        self, node: str, hashes: list[bytes], hold_s: float, tenant: Tenant | None = None
    ) -> None:
        deadline = time.monotonic() + self.client_config.timeout_s
        # The model's namespaces as any node knows them: the chosen node may hold the
        # prompt only in the object store, under a namespace it has not served yet.
        namespace_ids = set(self._namespace_ids(node, deadline))
        for _, ids in self._namespaces.values():
            namespace_ids.update(ids)
        client = self._client(node)
        for namespace_id in sorted(_theirs(namespace_ids, tenant)):
            keys = [block_key(namespace_id, h) for h in hashes]
            client.prefetch(keys, hold=hold_s, timeout=_left(deadline))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for client in self._clients.values():
            client.close()


def _theirs(namespace_ids: Iterable[bytes], tenant: Tenant | None) -> list[bytes]:
    """The namespaces a request may look at: with tenants, only its tenant's (as the nodes
    report them, scoped, to the router's cluster identity)."""
    return [n for n in namespace_ids if tenant is None or tenant.owns(n)]


def _left(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise PoolTimeout("prefix lookup ran out of time")
    return remaining


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
