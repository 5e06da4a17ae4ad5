import asyncio
import random
import signal
import socket
import time

import pytest

from diloco.protocol import canonical
from diloco.protocol.dht import ValueRecord
from diloco.protocol.dht.node import DHT_ROUTE, DHTConfig, DHTNode
from diloco.protocol.envelope import seal
from diloco.protocol.identity import Identity
from diloco.protocol.transport import PeerClient

from .helpers import Proc, cli


async def swarm(n: int, client: PeerClient, **kw) -> list[DHTNode]:
    nodes = [await DHTNode.start(client=client, **kw)]
    rng = random.Random(0)
    while len(nodes) < n:
        batch = min(8, n - len(nodes))
        nodes += await asyncio.gather(
            *(DHTNode.start(client=client, bootstrap=[rng.choice(nodes).url], **kw) for _ in range(batch))
        )
    return nodes


@pytest.fixture
async def client():
    c = PeerClient(retries=0)
    yield c
    await c.close()


async def stop_all(nodes):
    await asyncio.gather(*(n.stop() for n in nodes))


@pytest.mark.timeout(120)
async def test_every_value_is_found_from_every_node_of_64(client):
    nodes = await swarm(64, client)
    try:
        exp = time.time() + 600
        for i in range(5):
            assert await nodes[i * 7].store(f"key-{i}", f"value-{i}".encode(), exp) >= 10
        for i in range(5):
            got = await asyncio.gather(*(n.get(f"key-{i}") for n in nodes))
            assert got == [f"value-{i}".encode()] * 64, f"key-{i} missing on {got.count(None)} nodes"
    finally:
        await stop_all(nodes)


async def test_subkey_dictionary_merges_records_of_several_owners(client):
    nodes = await swarm(12, client)
    try:
        exp = time.time() + 60
        for n in nodes[:4]:
            await n.store("run:x:members", n.identity.peer_id.encode(), exp, subkey=n.identity.peer_id)
        got = await nodes[-1].get("run:x:members", latest=True)
        assert set(got) == {n.identity.peer_id for n in nodes[:4]}
        assert all(v == (k.encode(), exp) for k, v in got.items())
    finally:
        await stop_all(nodes)


async def test_values_survive_killing_a_tenth_of_the_nodes(client):
    nodes = await swarm(40, client)
    try:
        exp = time.time() + 600
        for i in range(10):
            await nodes[i].store(f"k{i}", b"v", exp)
        dead = nodes[30:]
        await stop_all(dead)  # servers gone: connections are refused from now on
        alive = nodes[:30]
        got = await asyncio.gather(*(random.choice(alive).get(f"k{i}") for i in range(10)))
        assert got == [b"v"] * 10
    finally:
        await stop_all(nodes[:30])


async def _send_store(client, node: DHTNode, sender: Identity, record_wire) -> list:
    sender_info = (await DHTNode.start(sender, client=client)).info
    payload = canonical.packb({"node": sender_info.to_wire(), "records": [record_wire]})
    env = seal(sender, "dht", node.network_id, {"op": "store"}, payload)
    raw = await client.send_envelope(node.url, DHT_ROUTE, env)
    reply = node._replies.open(raw)
    return canonical.unpackb(reply.payload, max_len=1 << 22)["stored"]


async def test_bad_records_are_refused_with_a_reason_and_stored_nowhere(client):
    nodes = await swarm(6, client)
    mallory, alice = Identity.generate(), Identity.generate()
    good = ValueRecord.create(mallory, "k", b"v", time.time() + 60)
    forged = {**ValueRecord.create(mallory, "members", b"v", time.time() + 60).to_wire(), "subkey": alice.peer_id}
    tampered = {**good.to_wire(), "value": b"w"}
    oversized = ValueRecord.create(mallory, "big", b"x" * (64 * 1024 + 1), time.time() + 60).to_wire()
    expired = ValueRecord.create(mallory, "old", b"v", time.time() - 1).to_wire()
    try:
        for wire, reason in [(forged, "ForgedSubkey"), (tampered, "BadSignature"), (oversized, "TooLarge"),
                             (expired, "Expired")]:
            for node in nodes:
                (result,) = await _send_store(client, node, mallory, wire)
                assert result is not None and result.startswith(reason), result
        for node in nodes:
            assert len(node.storage) == 0
            assert await node.get("members") is None and await node.get("big") is None
    finally:
        await stop_all(nodes)


async def test_silent_node_does_not_stall_a_lookup_past_its_deadline(client):
    nodes = await swarm(8, client, config=DHTConfig(rpc_deadline_s=0.5))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)  # accepts connections, never answers
    try:
        silent = await DHTNode.start(client=client)
        silent_info = silent.info.__class__.create(silent.identity, f"http://127.0.0.1:{sock.getsockname()[1]}")
        await silent.stop()
        for n in nodes:
            n.routing.update(silent_info)
        t = time.monotonic()
        await nodes[0].store("k", b"v", time.time() + 60)
        assert await nodes[3].get("k") == b"v"
        assert time.monotonic() - t < 3.0, "a silent node stalled the lookup"
        assert silent_info.node_id not in nodes[0].routing
    finally:
        sock.close()
        await stop_all(nodes)


async def test_a_bootstrap_peer_slow_to_answer_a_first_contact_is_asked_again_with_patience(client):
    """A fresh link's deadline (1 s) is a guess; a bootstrap peer on a busy host may need longer the first time."""
    from aiohttp import web

    from diloco.protocol.dht.node import BootstrapFailed

    first = await DHTNode.start(client=client)
    calls: list[float] = []

    async def slow_relay(request: web.Request) -> web.Response:  # (the first request waits 1.5 s)
        calls.append(time.monotonic())
        if len(calls) == 1:
            await asyncio.sleep(1.5)
        body = await client.request("POST", first.url, DHT_ROUTE, body=await request.read())
        return web.Response(body=bytes(body))

    app = web.Application()
    app.router.add_post(DHT_ROUTE, slow_relay)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    relay = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        late = await DHTNode.start(client=client, bootstrap=[relay])
        assert len(calls) >= 2 and first.identity.node_id in late.routing
        await late.stop()
        t = time.monotonic()
        with pytest.raises(BootstrapFailed, match="connect|refused|Cannot"):
            await DHTNode.start(client=client, bootstrap=[f"http://127.0.0.1:{refused.getsockname()[1]}"])
        assert time.monotonic() - t < 1.0, "a refused connection is not a slow peer: no second try"
        t = time.monotonic()
        with pytest.raises(BootstrapFailed, match="5.00s"):
            await DHTNode.start(client=client, bootstrap=[f"http://127.0.0.1:{silent.getsockname()[1]}"])
        assert time.monotonic() - t < 8.0
    finally:
        silent.close()
        refused.close()
        await runner.cleanup()
        await first.stop()


async def test_client_mode_nodes_never_enter_routing_tables(client):
    nodes = await swarm(6, client)
    try:
        light = await DHTNode.start(client=client, client_mode=True, bootstrap=[nodes[0].url])
        assert await light.store("from-client", b"hi", time.time() + 60) >= 5
        assert await nodes[4].get("from-client") == b"hi"
        assert await light.get("from-client") == b"hi"
        for n in nodes:
            assert light.identity.node_id not in n.routing
        await light.stop()
    finally:
        await stop_all(nodes)


@pytest.mark.timeout(90)
async def test_four_nodes_in_four_processes(client, tmp_path):
    procs = []
    try:
        first = Proc(cli("dht", "--listen", "127.0.0.1:0"))
        procs.append(first)
        url = first.wait_for(r"announced as (\S+)").group(1)
        for _ in range(3):
            p = Proc(cli("dht", "--listen", "127.0.0.1:0", "--peers", url))
            procs.append(p)
            p.wait_for(r"joined: \d+ nodes")
        me = await DHTNode.start(client=client, bootstrap=[url])
        assert len(me.routing) == 4
        assert await me.store("shared", b"across processes", time.time() + 60) == 5
        other = await DHTNode.start(client=client, bootstrap=[url])
        await me.stop()
        assert await other.get("shared") == b"across processes"
        await other.stop()
        procs[1].kill(signal.SIGINT)
        assert procs[1].popen.returncode == 0
    finally:
        for p in procs:
            p.kill()


async def test_a_lookup_that_reaches_its_quorum_early_keeps_its_connections(client, monkeypatch):
    """An RPC the lookup no longer needs is left to finish: cancelling it mid-flight made aiohttp close the
    pooled connection (a new TCP handshake for the next RPC, and a reference cycle for the rare full GC)."""
    slow: set[int] = set()
    handle = DHTNode._handle

    async def delayed(self, env, request):  # nodes in `slow` answer 0.1 s late
        if id(self) in slow:
            await asyncio.sleep(0.1)
        return await handle(self, env, request)

    monkeypatch.setattr(DHTNode, "_handle", delayed)  # before the nodes bind it to their routes
    holder = await DHTNode.start(client=client)
    others = [await DHTNode.start(client=client, bootstrap=[holder.url]) for _ in range(3)]
    getter, nodes = others[0], [holder, *others]
    try:
        assert len(getter.routing.closest(0, 20)) == 3  # alpha = 3: every lookup asks all three at once
        holder.storage.store(ValueRecord.create(holder.identity, "k", b"v", time.time() + 60))
        slow.update(id(n) for n in others[1:])  # the holder answers first: the lookup is done before them
        for _ in range(2):  # every link gets its pooled connection
            assert await getter.get("k") == b"v"
            await asyncio.sleep(0.2)
        opened = client.counters.connections_opened
        for _ in range(10):
            assert await getter.get("k") == b"v"
            await asyncio.sleep(0.2)  # (a lookup's late answers are in before the next one)
        assert client.counters.connections_opened - opened == 0
    finally:
        await stop_all(nodes)


async def test_a_full_bucket_pings_its_oldest_contact_however_many_lookup_rpcs_are_left_to_finish(client):
    """Kademlia's liveness check: a newcomer to a full bucket makes us ping its least-recently-seen contact, and
    a dead one gives its place to the newcomer. The RPCs that lookups leave to finish must not crowd it out."""
    from diloco.protocol.dht.records import NodeInfo
    from diloco.protocol.dht.routing import bucket_index

    node = await DHTNode.start(client=client, config=DHTConfig(k=2))
    with socket.socket() as s:  # a port that refuses connections: where the dead contacts were
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    ids: list[Identity] = []  # three identities in one bucket of the node's table: two fill it, one arrives
    while len(ids) < 3:
        i = Identity.generate()
        if bucket_index(node.identity.node_id, NodeInfo.create(i, dead_url).node_id) == 159:
            ids.append(i)
    dead = [NodeInfo.create(i, dead_url) for i in ids[:2]]
    for info in dead:
        assert node.routing.update(info) is None
    lingering = [asyncio.create_task(asyncio.sleep(60)) for _ in range(64)]
    for task in lingering:  # 64 late answers (at most alpha − 1 = 2 per lookup): the old shared cap of 64
        node._finish_in_background(task)
    newcomer = await DHTNode.start(ids[2], client=client)
    try:
        assert (await newcomer._rpc(node.url, "ping", {}, node.identity.node_id))["node"] == node.info
        deadline = time.monotonic() + 10
        while newcomer.identity.node_id not in node.routing and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert newcomer.identity.node_id in node.routing, "the newcomer took the dead contact's place"
        assert dead[0].node_id not in node.routing and dead[1].node_id in node.routing
    finally:
        await stop_all([node, newcomer])


async def _find_value(client, node: DHTNode, asker: DHTNode, key: str, have: list) -> dict:
    return await asker._rpc(node.url, "find_value", {"key": key, "have": have}, node.identity.node_id)


async def test_a_replier_answers_by_prefix_the_records_a_reader_names_and_sends_the_others_in_full(client):
    nodes = await swarm(4, client)
    a, b = nodes[0], nodes[1]
    key, exp = "run:x:members", time.time() + 60
    try:
        for n in nodes:
            await n.store(key, n.identity.peer_id.encode(), exp, subkey=n.identity.peer_id)
        held = {r.signature[:8]: r for r in a.storage.get(key).subkeys.values()}
        assert len(held) == 4
        reply = await _find_value(client, b, a, key, sorted(held))
        assert reply["records"] == [] and reply["same"] == set(held)  # 4 prefixes of 8 bytes, no record
        full = await _find_value(client, b, a, key, [])
        assert {r.signature[:8] for r in full["records"]} == set(held) and full["same"] == set()
        # a newer record only b holds comes in full, and the reader's get merges it with what it named
        newer = ValueRecord.create(nodes[2].identity, key, b"newer", exp + 10, nodes[2].identity.peer_id)
        b.storage.store(newer)
        for n in nodes[2:]:
            n.storage.store(newer)
        reply = await _find_value(client, b, a, key, sorted(held))
        assert [r.value for r in reply["records"]] == [b"newer"] and len(reply["same"]) == 3
        got = await a.get(key, latest=True)
        assert set(got) == {n.identity.peer_id for n in nodes} and got[nodes[2].identity.peer_id][0] == b"newer"
        # a prefix the reader never named, or no record of its own, adds nothing to what it reads
        lone = await DHTNode.start(client=client, bootstrap=[b.url])
        nodes.append(lone)
        reply = await _find_value(client, b, lone, key, [b"\0" * 8])
        assert len(reply["records"]) == 4 and reply["same"] == set()
        assert set(await lone.get(key, latest=True)) == {n.identity.peer_id for n in nodes[:4]}
    finally:
        await stop_all(nodes)


@pytest.mark.parametrize("have", [[b"short"], [b"x" * 9], "not a list", [b"\0" * 8] * 10_001])
async def test_a_malformed_have_list_is_refused_and_changes_nothing(client, have):
    nodes = await swarm(2, client)
    try:
        await nodes[1].store("k", b"v", time.time() + 60)
        before = len(nodes[1].storage)
        with pytest.raises(Exception, match="400|have"):
            await _find_value(client, nodes[1], nodes[0], "k", have)
        assert len(nodes[1].storage) == before
    finally:
        await stop_all(nodes)


async def test_a_replier_leaves_out_of_its_contacts_the_nodes_a_lookup_names_as_known(client):
    nodes = await swarm(6, client)
    a, b = nodes[0], nodes[1]
    try:
        target = random.Random(1).getrandbits(160)
        theirs = [n for n in b.routing.closest(target, 20) if n.node_id != a.identity.node_id]
        assert len(theirs) >= 3
        named, unnamed = theirs[:2], theirs[2:]
        # (a prefix of no NodeInfo b holds, e.g. of an older address of a node that moved, hides nothing)
        known = [n.signature[:8] for n in named] + [b"\0" * 8]
        for op, body in (("find_node", {"target": target.to_bytes(20, "big")}), ("find_value", {"key": "k"})):
            reply = await a._rpc(b.url, op, {**body, "known": known}, b.identity.node_id)
            got = [n.node_id for n in reply["nodes"]]
            if op == "find_node":
                assert got == [n.node_id for n in unnamed]
            assert not {n.node_id for n in named} & set(got)
        # a lookup names the contacts it starts from: a poll among nodes that all know each other moves none
        sent: list[dict] = []
        rpc = a._rpc

        async def spy(url, op, body, expect):
            reply = await rpc(url, op, body, expect)
            if op != "store":
                sent.append({"op": op, "known": len(body.get("known", [])), "nodes": len(reply["nodes"])})
            return reply

        a._rpc = spy
        await a.store("m", b"v", time.time() + 60, subkey=a.identity.peer_id)
        await a.get("m", latest=True)
        assert any(s["op"] == "find_value" for s in sent) and all(s["known"] == 5 for s in sent), sent
        assert all(s["nodes"] == 0 for s in sent), sent
    finally:
        await stop_all(nodes)


@pytest.mark.parametrize("known", [[b"short"], "not a list", [b"\0" * 8] * 65])
async def test_a_malformed_known_list_is_refused(client, known):
    nodes = await swarm(2, client)
    try:
        with pytest.raises(Exception, match="400|known"):
            await nodes[0]._rpc(nodes[1].url, "find_node", {"target": b"\0" * 20, "known": known},
                                nodes[1].identity.node_id)
    finally:
        await stop_all(nodes)


async def test_a_poll_for_the_latest_dictionary_asks_no_more_nodes_than_its_quorum_needs(client, monkeypatch):
    asked: list[str] = []
    handle = DHTNode._handle

    async def counting(self, env, request):
        asked.append(env.fields.get("op"))
        return await handle(self, env, request)

    monkeypatch.setattr(DHTNode, "_handle", counting)  # before the nodes bind it to their routes
    nodes = await swarm(4, client)
    try:
        for n in nodes:
            await n.store("m", b"v", time.time() + 60, subkey=n.identity.peer_id)
        asked.clear()
        assert len(await nodes[0].get("m", latest=True)) == 4
        assert asked == ["find_value", "find_value"]  # the local copy and 2 replies make the quorum of 3
    finally:
        await stop_all(nodes)
