"""The networked Kademlia node: RPC handlers and iterative lookups over `POST /v1/dht` (docs/architecture.md §4).

Requests and replies are both envelopes (`dht` and `dht.reply`), so a reply is proven to come from the node it
names and to answer this very request (`reply_to` is the request's nonce). Every request carries the sender's
signed `NodeInfo`; receivers add non-client senders to their routing table, Kademlia style.

One maintenance task per node owns every periodic job (bucket refresh, republish of this node's own records,
purge of expired values); lookups bound each RPC by the transport's adaptive deadline, and no lookup waits on a
silent node longer than that. This module never stores a record that `DHTStorage` refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .. import canonical
from ..envelope import Envelope, EnvelopeVerifier, register_kind, seal
from ..errors import Malformed, ProtocolError
from ..identity import Identity
from ..transport import DeadlineExceeded, PeerClient, PeerServer, TransportError
from .records import NodeInfo, ValueRecord
from .routing import RoutingTable, key_id
from .storage import DHTStorage

log = logging.getLogger(__name__)

DHT_ROUTE = "/v1/dht"
DEFAULT_NETWORK_ID = hashlib.sha256(b"diloco-node/dht/v1").digest()
MAX_REQUEST = 1024 * 1024
MAX_REPLY = 4 * 1024 * 1024
MAX_RECORDS_PER_STORE = 64
BOOTSTRAP_DEADLINE_S = 5.0  # a bootstrap ping that ran out of the link's first estimate is retried with this
MAX_PINGS = 64  # liveness pings of full buckets' oldest contacts in flight at once
HAVE_BYTES = 8  # a record named in `have`/`same` by its signature's first bytes (docs/protocol.md §5.5)
MAX_HAVE = 10_000
MAX_KNOWN = 64  # NodeInfos a lookup names in `known`, by signature prefix: a replier leaves them out of `nodes`
SEEN_KEYS = 256  # keys whose last `get_records` result is kept, to name in the next lookup's `have`
register_kind("dht", MAX_REQUEST)
register_kind("dht.reply", MAX_REPLY)


class BootstrapFailed(Exception):
    """None of the bootstrap peers answered."""


@dataclass
class DHTConfig:
    k: int = 20
    alpha: int = 3
    refresh_s: float = 60.0
    republish_s: float = 60.0
    purge_s: float = 30.0
    rpc_deadline_s: float | None = None  # None: the transport's adaptive deadline


class DHTNode:
    """One DHT participant. Create with `await DHTNode.start(...)`; `await node.stop()` when done."""

    def __init__(
        self,
        identity: Identity,
        client: PeerClient,
        *,
        server: PeerServer | None,
        url: str = "",
        region: str = "",
        network_id: bytes = DEFAULT_NETWORK_ID,
        config: DHTConfig | None = None,
        storage: DHTStorage | None = None,
        is_member: Callable[[bytes], bool] | None = None,
    ) -> None:
        """`is_member`: whose requests this node's server answers (a private run's members; None: anyone's)."""
        self.identity = identity
        self.client = client
        self.server = server
        self.client_mode = server is None
        self.network_id = network_id
        self.config = config or DHTConfig()
        self.storage = storage or DHTStorage()
        self.routing: RoutingTable[NodeInfo] = RoutingTable(identity.node_id, k=self.config.k)
        self.region = region
        self.info = NodeInfo.create(identity, "", region, client_mode=True)  # until `announce`
        if url or self.client_mode:
            self.announce(url)
        self._replies = EnvelopeVerifier(network_id, kinds={"dht.reply"})
        self._own: dict[tuple[str, str | None], ValueRecord] = {}
        self._seen: dict[str, list[ValueRecord]] = {}  # key -> the records its last get returned (`_known`)
        self._tasks: set[asyncio.Task] = set()
        self._pinging: set[int] = set()  # node ids with a liveness ping in flight (see `_saw`)
        self._maintenance: asyncio.Task | None = None
        self._owns_server = False
        if server is not None:
            server.add_envelope_route(DHT_ROUTE, EnvelopeVerifier(network_id, is_member=is_member), self._handle,
                                      kinds={"dht"})

    @classmethod
    async def start(
        cls,
        identity: Identity | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        announce: str | None = None,
        bootstrap: Iterable[str] = (),
        client_mode: bool = False,
        client: PeerClient | None = None,
        server: PeerServer | None = None,
        **kw: Any,
    ) -> DHTNode:
        """Start a node (its own server unless `client_mode` or one is given) and join through `bootstrap`."""
        identity = identity or Identity.generate()
        owns_server = server is None and not client_mode
        if owns_server:
            server = PeerServer(host, port)
        node = cls(identity, client or PeerClient(retries=0), server=server, **kw)
        if owns_server:
            await server.start()
        if server is not None:
            node.announce(announce or server.url)
        node._maintenance = asyncio.create_task(node._maintain())
        node._owns_server = owns_server
        urls = list(bootstrap)
        if urls:
            await node.bootstrap(urls)
        return node

    @property
    def url(self) -> str:
        return self.info.url

    def announce(self, url: str) -> None:
        """Set the address other nodes should use for us (signed into our NodeInfo)."""
        self.info = NodeInfo.create(self.identity, url, self.region, client_mode=self.client_mode)

    async def stop(self) -> None:
        for task in [self._maintenance, *self._tasks]:
            if task is not None:
                task.cancel()
        for task in [self._maintenance, *self._tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.server is not None and self._owns_server:
            await self.server.stop()

    # -- public API ---------------------------------------------------------------------------------------

    async def bootstrap(self, urls: Iterable[str], *, lookup: bool = True) -> None:
        """Ping the given peers, then look up our own id to fill the routing table. With `lookup` false the
        caller runs that lookup (`find_node(identity.node_id)`) itself, alongside its first requests."""
        urls = list(urls)
        reasons: dict[str, BaseException] = {}
        for patient in (False, True):
            results = await asyncio.gather(*(self.ping(u, patient=patient) for u in urls), return_exceptions=True)
            if any(isinstance(r, NodeInfo) for r in results):
                break
            reasons.update(zip(urls, results, strict=True))
            urls = [u for u, r in zip(urls, results, strict=True) if isinstance(r, DeadlineExceeded)]  # (again, patiently)
            if patient or not urls:
                why = "; ".join(map(str, reasons.values()))
                raise BootstrapFailed(f"none of the bootstrap peers answered ({why})")
        if lookup:
            await self.find_node(self.identity.node_id)

    async def ping(self, url: str, *, patient: bool = False) -> NodeInfo:
        """Ask `url` who it is; a valid answer adds it to the routing table. `patient`: wait at least
        BOOTSTRAP_DEADLINE_S (a bootstrap peer is the only way in, and a first contact on a busy host can take
        longer than the estimate a link starts with)."""
        reply = await self._rpc(url, "ping", {}, None, min_deadline_s=BOOTSTRAP_DEADLINE_S if patient else 0.0)
        return reply["node"]

    async def find_node(self, target: int) -> list[NodeInfo]:
        """The k closest live nodes to `target` that answered (iterative lookup)."""
        nodes, _ = await self._lookup(target, None, 0)
        return nodes

    async def store(self, key: str, value: bytes, expiration: float, subkey: str | None = None) -> int:
        """Sign and store `value` on the k nodes closest to `key`; returns how many accepted it.

        With a `subkey`, it must be this node's PeerId (records under a subkey are its owner's alone).
        The record is republished by this node until it expires.
        """
        record = ValueRecord.create(self.identity, key, value, expiration, subkey)
        self._own[(key, subkey)] = record
        return await self.store_record(record)

    async def store_record(self, record: ValueRecord) -> int:
        """Store an already signed record (ours, or one we relay) on the k closest nodes."""
        target = key_id(record.key)
        nodes, _ = await self._lookup(target, None, 0)
        stored = 0
        if self._among_closest(target, nodes):
            with contextlib.suppress(ProtocolError):
                self.storage.store(record)
                stored += 1
        results = await asyncio.gather(
            *(self._rpc(n.url, "store", {"records": [record.to_wire()]}, n.node_id) for n in nodes),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, dict) and r["stored"] and r["stored"][0] is None:
                stored += 1
        return stored

    async def get(self, key: str, *, latest: bool = False) -> bytes | dict[str, tuple[bytes, float]] | None:
        """The value under `key`: bytes for a plain key, `{subkey: (value, expiration)}` for a dictionary,
        None if nobody holds it. `latest` asks more nodes (3) before answering, for fresher dictionaries."""
        records = await self.get_records(key, quorum=3 if latest else 1)
        if not records:
            return None
        subkeys = {r.subkey: (r.value, r.expiration) for r in records if r.subkey is not None}
        if subkeys:
            return subkeys
        return max((r for r in records if r.subkey is None), key=lambda r: (r.expiration, r.signature)).value

    async def get_records(self, key: str, *, quorum: int = 1) -> list[ValueRecord]:
        """Live records of `key` (the newest per subkey) from the first `quorum` nodes that hold any."""
        found: list[list[ValueRecord]] = []
        local = self.storage.get(key)
        if local is not None:
            found.append(_records_of(local.plain, local.subkeys.values()))
        if len(found) < quorum:
            _, remote = await self._lookup(key_id(key), key, quorum - len(found), self._known(key, found))
            found.extend(remote)
        newest: dict[str | None, ValueRecord] = {}
        now = time.time()
        for rec in (r for batch in found for r in batch):
            held = newest.get(rec.subkey)
            if rec.expiration > now and (held is None or rec.supersedes(held)):
                newest[rec.subkey] = rec
        self._seen.pop(key, None)
        self._seen[key] = list(newest.values())
        while len(self._seen) > SEEN_KEYS:
            del self._seen[next(iter(self._seen))]
        return list(newest.values())

    def _known(self, key: str, local: list[list[ValueRecord]]) -> dict[bytes, ValueRecord]:
        """The live records of `key` this node holds or last read, by signature prefix: a `find_value` names
        them in `have`, and a replier holding the same record answers its prefix instead of the record."""
        now = time.time()
        held = [r for batch in local for r in batch] + self._seen.get(key, [])
        return {r.signature[:HAVE_BYTES]: r for r in held if r.expiration > now}

    # -- lookups ------------------------------------------------------------------------------------------

    async def _lookup(
        self, target: int, key: str | None, quorum: int, known: dict[bytes, ValueRecord] | None = None
    ) -> tuple[list[NodeInfo], list[list[ValueRecord]]]:
        """Iterative FIND_NODE (key None) or FIND_VALUE with α RPCs in flight; a FIND_VALUE for a quorum of 2
        or more (a poll for the latest dictionary) keeps no more in flight than the batches it still needs, so
        it reads no answer it then throws away. A read for one batch keeps α: its latency is someone's wait.

        Ends when the k closest known nodes have all answered, when candidates run out, or, for FIND_VALUE,
        when `quorum` nodes returned records. `known`: records a replier may answer by prefix (`_known`).
        """
        known = known or {}
        k, alpha = self.config.k, self.config.alpha
        candidates = {n.node_id: n for n in self.routing.closest(target, k)}
        # (the contacts we start from: a replier leaves them out of its `nodes`, which would only repeat them)
        named = {"known": sorted({n.signature[:HAVE_BYTES] for n in candidates.values()})} if candidates else {}
        answered: set[int] = set()
        failed: set[int] = set()
        values: list[list[ValueRecord]] = []
        pending: dict[asyncio.Task, NodeInfo] = {}
        if key is None:
            op, body = "find_node", {"target": _id_bytes(target), **named}
        else:
            op, body = "find_value", {"key": key, **named, **({"have": sorted(known)[:MAX_HAVE]} if known else {})}
        if target != self.identity.node_id:
            self.routing.touch_bucket_for(target)
        try:
            while True:
                ranked = sorted((n for i, n in candidates.items() if i not in failed), key=lambda n: n.node_id ^ target)
                ranked = ranked[:k]
                if key is not None and len(values) >= quorum:
                    break
                asked = answered | failed | {pending[t].node_id for t in pending}
                width = alpha if key is None or quorum < 2 else min(alpha, quorum - len(values))
                for n in [n for n in ranked if n.node_id not in asked][: width - len(pending)]:
                    pending[asyncio.create_task(self._rpc(n.url, op, body, n.node_id))] = n
                if not pending:
                    break
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    node = pending.pop(task)
                    try:
                        reply = task.result()
                    except (TransportError, ProtocolError) as e:
                        log.debug("lookup: %s failed: %s", node.url, e)
                        failed.add(node.node_id)
                        continue
                    answered.add(node.node_id)
                    for n in reply["nodes"]:
                        if n.node_id != self.identity.node_id and not n.client_mode:
                            candidates.setdefault(n.node_id, n)
                    records = [r for r in reply.get("records", ()) if r.key == key]
                    records += [known[p] for p in reply.get("same", ()) if p in known]
                    if records:
                        values.append(records)
        finally:
            for task in pending:  # let them answer (see `_finish_in_background`)
                self._finish_in_background(task)
        closest = sorted((candidates[i] for i in answered), key=lambda n: n.node_id ^ target)[:k]
        return closest, values

    def _finish_in_background(self, task: asyncio.Task) -> None:
        """An RPC a lookup no longer needs is left to finish (within its deadline) rather than cancelled.

        Cancelling a request already on the wire makes aiohttp close its pooled connection: the next RPC to
        that node pays a new TCP handshake, and the closed connection leaves a reference cycle (transport,
        protocol, the error it stored) that only CPython's rare full collection frees. A lookup that reaches
        its quorum early did this on most polls. The late answer still refreshes the routing table.
        """
        self._track(task)
        task.add_done_callback(_ignore_outcome)

    def _among_closest(self, target: int, nodes: list[NodeInfo]) -> bool:
        if self.client_mode:
            return False
        if len(nodes) < self.config.k:
            return True
        return (self.identity.node_id ^ target) < (nodes[-1].node_id ^ target)

    # -- RPC client side ----------------------------------------------------------------------------------

    async def _rpc(
        self, url: str, op: str, body: dict[str, Any], expect: int | None, min_deadline_s: float = 0.0
    ) -> dict[str, Any]:
        payload = canonical.packb({"node": self.info.to_wire(), **body})
        request = seal(self.identity, "dht", self.network_id, {"op": op}, payload)
        try:
            raw = await self.client.send_envelope(
                url, DHT_ROUTE, request, deadline_s=self.config.rpc_deadline_s, max_response=MAX_REPLY + 70_000,
                min_deadline_s=min_deadline_s,
            )
            reply = self._replies.open(raw)
            if reply.fields != {"reply_to": request.nonce}:
                raise Malformed("reply does not answer this request")
            out = _decode_reply(reply, op)
        except (TransportError, ProtocolError):
            if expect is not None:
                self.routing.remove(expect)
            raise
        if expect is not None and out["node"].node_id != expect:
            self.routing.remove(expect)
            raise Malformed(f"{url} answered as another node")
        self._saw(out["node"])
        return out

    def _saw(self, info: NodeInfo) -> None:
        """Kademlia: every node we hear from goes into the routing table; a full bucket pings its oldest."""
        if info.client_mode or info.node_id == self.identity.node_id:
            return
        oldest = self.routing.update(info)
        if oldest is not None and oldest.node_id not in self._pinging and len(self._pinging) < MAX_PINGS:
            self._pinging.add(oldest.node_id)  # (counted apart from the other background tasks: the RPCs that
            self._spawn(self._check_alive(oldest))  # lookups leave to finish must not crowd these out)

    async def _check_alive(self, contact: NodeInfo) -> None:
        try:
            with contextlib.suppress(TransportError, ProtocolError):
                await self._rpc(contact.url, "ping", {}, contact.node_id)  # a failure removes it
        finally:
            self._pinging.discard(contact.node_id)

    def _spawn(self, coro) -> None:
        self._track(asyncio.create_task(coro))

    def _track(self, task: asyncio.Task) -> None:
        """Keep a background task until it ends; `stop()` cancels what is left."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- RPC server side ----------------------------------------------------------------------------------

    async def _handle(self, env: Envelope, request: Any) -> bytes:
        body = canonical.unpackb(env.payload, max_len=MAX_REQUEST, strict=False)
        if not isinstance(body, dict) or not isinstance(body.get("node"), dict):
            raise Malformed("dht request must be a map with the sender's node info")
        sender = NodeInfo.from_wire(body["node"])
        if sender.public_key != env.sender:
            raise Malformed("node info does not belong to the envelope's signer")
        op = env.fields.get("op")
        if op == "ping":
            out: dict[str, Any] = {}
        elif op == "find_node":
            target = _target(body.get("target"))
            out = {"nodes": self._contacts(target, sender, body)}
        elif op == "find_value":
            key = body.get("key")
            if not isinstance(key, str):
                raise Malformed("find_value needs a string key")
            have = _have(body.get("have", []))
            held = self.storage.get(key)
            nodes = self._contacts(key_id(key), sender, body)
            recs = _records_of(held.plain, held.subkeys.values()) if held else []
            same = [r.signature[:HAVE_BYTES] for r in recs if r.signature[:HAVE_BYTES] in have]
            out = {"nodes": nodes,
                   "records": [r.to_wire() for r in recs if r.signature[:HAVE_BYTES] not in have],
                   **({"same": same} if same else {})}
        elif op == "store":
            out = {"stored": self._store_many(body.get("records"))}
        else:
            raise Malformed(f"unknown dht op {op!r}")
        self._saw(sender)
        payload = canonical.packb({"node": self.info.to_wire(), **out})
        return seal(self.identity, "dht.reply", self.network_id, {"reply_to": env.nonce}, payload).to_bytes()

    def _contacts(self, target: int, sender: NodeInfo, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Up to k contacts closest to `target`, without the requester and the NodeInfos it names in `known`."""
        known = _have(body.get("known", []), "known", MAX_KNOWN)
        closest = self.routing.closest(target, self.config.k, exclude={sender.node_id})
        return [n.to_wire() for n in closest if n.signature[:HAVE_BYTES] not in known]

    def _store_many(self, records: Any) -> list[str | None]:
        if not isinstance(records, list) or len(records) > MAX_RECORDS_PER_STORE:
            raise Malformed(f"store needs a list of at most {MAX_RECORDS_PER_STORE} records")
        results: list[str | None] = []
        for wire in records:
            try:
                self.storage.store(ValueRecord.from_wire(wire))
                results.append(None)
            except ProtocolError as e:
                results.append(f"{type(e).__name__}: {e.reason}")
        return results

    # -- maintenance --------------------------------------------------------------------------------------

    async def _maintain(self) -> None:
        """The one periodic loop: refresh stale buckets, republish our records, purge expired values."""
        cfg = self.config
        due = {"refresh": time.monotonic() + cfg.refresh_s, "republish": time.monotonic() + cfg.republish_s,
               "purge": time.monotonic() + cfg.purge_s}
        while True:
            job = min(due, key=due.__getitem__)
            await asyncio.sleep(max(0.0, due[job] - time.monotonic()))
            try:
                if job == "refresh":
                    for target in self.routing.stale_buckets(cfg.refresh_s):
                        await self.find_node(target)
                elif job == "republish":
                    now = time.time()
                    self._own = {k: r for k, r in self._own.items() if r.expiration > now}
                    for record in list(self._own.values()):
                        await self.store_record(record)
                else:
                    self.storage.purge()
            except Exception:  # a maintenance failure must never kill the loop
                log.exception("dht maintenance job %s failed", job)
            due[job] = time.monotonic() + getattr(cfg, f"{job}_s")


def _id_bytes(node_id: int) -> bytes:
    return node_id.to_bytes(20, "big")


def _target(raw: Any) -> int:
    if not isinstance(raw, bytes) or len(raw) != 20:
        raise Malformed("target must be 20 bytes")
    return int.from_bytes(raw, "big")


def _have(raw: Any, name: str = "have", limit: int = MAX_HAVE) -> set[bytes]:
    """A `have`, `same` or `known` list: at most `limit` signature prefixes of `HAVE_BYTES` bytes each."""
    if not isinstance(raw, list) or len(raw) > limit:
        raise Malformed(f"{name} must list at most {limit} signature prefixes")
    if not all(isinstance(p, bytes) and len(p) == HAVE_BYTES for p in raw):
        raise Malformed(f"each {name} entry is {HAVE_BYTES} bytes")
    return set(raw)


def _records_of(plain: ValueRecord | None, subkeys: Iterable[ValueRecord]) -> list[ValueRecord]:
    return ([plain] if plain is not None else []) + list(subkeys)


def _decode_reply(reply: Envelope, op: str) -> dict[str, Any]:
    body = canonical.unpackb(reply.payload, max_len=MAX_REPLY, strict=False)
    if not isinstance(body, dict):
        raise Malformed("dht reply must be a map")
    node = NodeInfo.from_wire(body.get("node"))
    if node.public_key != reply.sender:
        raise Malformed("reply's node info does not belong to its signer")
    out: dict[str, Any] = {"node": node, "nodes": []}
    if op in ("find_node", "find_value"):
        nodes = body.get("nodes")
        if not isinstance(nodes, list) or len(nodes) > 64:
            raise Malformed("reply must list at most 64 nodes")
        out["nodes"] = [NodeInfo.from_wire(n) for n in nodes]
    if op == "find_value":
        recs = body.get("records")
        if not isinstance(recs, list) or len(recs) > 10_000:
            raise Malformed("reply records must be a list")
        out["records"] = [ValueRecord.from_wire(r) for r in recs]
        out["same"] = _have(body.get("same", []))
    if op == "store":
        stored = body.get("stored")
        if not isinstance(stored, list) or not all(s is None or isinstance(s, str) for s in stored):
            raise Malformed("store reply must list per-record results")
        out["stored"] = stored
    return out


def _ignore_outcome(task: asyncio.Task) -> None:
    """Retrieve a background RPC's outcome: its failure was already handled (routing) inside `_rpc`."""
    if not task.cancelled():
        task.exception()
