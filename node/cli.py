"""The `diloco-node` command line: every subcommand a user types lives here, thin over the Python API.

Errors a user can cause print one line saying what happened and what to do, never a traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

import click

from diloco.protocol.identity import Identity, KeyFileError

from . import __version__
from .config import ConfigCommand

DEFAULT_KEY = Path("~/.config/diloco-node/key.pem")


class UserError(click.ClickException):
    """A one-line error for the user, printed without a traceback."""


def _setup_logging(level: str, fmt: str) -> None:
    if fmt == "json":
        import json

        class _Json(logging.Formatter):
            def format(self, r: logging.LogRecord) -> str:
                return json.dumps({"t": r.created, "level": r.levelname, "logger": r.name, "msg": r.getMessage()})

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Json())
        logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="diloco-node")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Logging verbosity.")
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              help="Log line format; json writes one object per line to stderr.")
def main(log_level: str, log_format: str) -> None:
    """diloco-node: train one model across many machines with Decoupled DiLoCo.

    Peers find each other through a DHT and exchange signed, compressed pseudo-gradients over HTTP on one
    port each. No central server. Start with `diloco-node keygen`.
    """
    _setup_logging(log_level, log_format)


@main.command()
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_KEY,
              show_default=True, help="Where to write the PEM private key (created with mode 0600).")
@click.option("--force", is_flag=True, help="Overwrite an existing key file.")
def keygen(out: Path, force: bool) -> None:
    """Create an Ed25519 identity and print its PeerId.

    The key signs everything this peer sends; keep it private. A key file readable by group or others is
    refused when loaded.
    """
    ident = Identity.generate()
    try:
        path = ident.save(out, overwrite=force)
    except KeyFileError as e:
        raise UserError(str(e)) from None
    click.echo(f"peer_id: {ident.peer_id}")
    click.echo(f"public_key: {ident.public_key.hex()}")
    click.echo(f"key_file: {path}")


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host or int(port) > 65535:
        raise UserError(f"{value!r} is not HOST:PORT with a port in 0-65535 (for example 0.0.0.0:7000)")
    return host.strip("[]"), int(port)


def _peer_url(value: str) -> str:
    if value.startswith(("http://", "https://")):
        return value.rstrip("/")
    host, port = _hostport(value)
    return f"http://{host}:{port}"


@main.command()
@click.option("--listen", default="0.0.0.0:7000", show_default=True, help="HOST:PORT to serve the DHT on.")
@click.option("--announce", default=None, help="URL other peers should use to reach this node "
              "(default: http://LISTEN; set it behind a 1:1 NAT or when listening on 0.0.0.0).")
@click.option("--peers", multiple=True, help="HOST:PORT (or URL) of a node already in the DHT; repeatable.")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Key file (created if missing). Default: a fresh key each start.")
@click.option("--region", default="", help="Free-form region label published in this node's info.")
def dht(listen: str, announce: str | None, peers: tuple[str, ...], key: Path | None, region: str) -> None:
    """Run a bootstrap-only DHT node: it routes and stores records, trains nothing.

    Prints its address and PeerId, then serves until Ctrl-C.
    """
    import asyncio

    from diloco.protocol.dht.node import BootstrapFailed, DHTNode

    host, port = _hostport(listen)
    ident = load_identity(key)

    async def serve() -> None:
        try:
            node = await DHTNode.start(ident, host=host, port=port, announce=announce, region=region)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {host}:{port} is in use (another node? pick --listen HOST:OTHERPORT)") from None
            raise UserError(f"cannot listen on {listen}: {e.strerror or e}") from None
        try:
            if announce is None and host in ("0.0.0.0", "::"):
                click.echo("warning: listening on all interfaces; pass --announce URL so others can reach you",
                           err=True)
            click.echo(f"dht node {ident.peer_id} listening on {node.server.url}, announced as {node.url}")
            click.echo(f"others join with: --peers {node.url}", err=False)
            if peers:
                try:
                    await node.bootstrap([_peer_url(p) for p in peers])
                except BootstrapFailed as e:
                    raise UserError(f"{e}; check --peers") from None
                click.echo(f"joined: {len(node.routing)} nodes in the routing table")
            sys.stdout.flush()
            await asyncio.Event().wait()
        finally:
            await node.stop()
            await node.client.close()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        click.echo("dht node stopped", err=True)


def _swarm_config(listen: str, announce: str | None, peers: tuple[str, ...], client_mode: bool, region: str,
                  fast: bool = False, wait_for_peers: float = 0.0, operator_listen: str | None = None):
    from .swarm import SwarmConfig

    host, port = _hostport(listen)
    cfg = SwarmConfig(host=host, port=port, announce=announce, peers=[_peer_url(p) for p in peers],
                      client_mode=True if client_mode else None, region=region,
                      bootstrap_wait_s=wait_for_peers,
                      operator_listen=_hostport(operator_listen) if operator_listen else None)
    if fast:  # localhost fleets: notice departures within seconds
        cfg.member_ttl_s, cfg.member_refresh_s, cfg.member_poll_s, cfg.watch_s = 6.0, 2.0, 1.0, 2.0
    return cfg


def _load_run(path: Path):
    from diloco.coordinator.runspec import Genesis
    from diloco.protocol.errors import ProtocolError

    try:
        return Genesis.load(path)
    except ProtocolError as e:
        raise UserError(f"run spec {path}: {e.reason.rstrip('.')}; pass the file `diloco-node init-run` wrote") from None
    except OSError as e:
        raise UserError(f"run spec {path}: {e.strerror or e}") from None


def check_codec(name: str) -> None:
    """A codec name a run can use (`--codec`), or a `UserError` naming the choices."""
    from diloco.protocol.codecs import available_codecs, get_codec
    from diloco.protocol.errors import Malformed

    try:
        get_codec(name)
    except Malformed as e:
        raise UserError(e.reason if ":" in name else f"unknown codec {name!r}; choose one of "
                        f"{', '.join(available_codecs())} (or a sparse variant topk:CHUNK:K:BITS)") from None


@main.command("init-run")
@click.option("--name", required=True, help="Run name (shown to peers).")
@click.option("--task", default="markov", show_default=True, help="Built-in task: markov, kjv or file:PATH; or "
              "hf:CONFIG.json, a Hugging Face causal LM built from that local config (stored in the spec; vocab_size "
              "256, trained on the KJV bytes; needs `pip install 'diloco-node[hf]'`).")
@click.option("--model", "preset", default="tiny", show_default=True, help="Model preset of the built-in GPT: "
              "tiny or small.")
@click.option("--fragments", default=4, show_default=True, help="P: fragments the model is cut into.")
@click.option("--inner-steps", type=int, default=None, help="H: inner steps between two deltas of a fragment.  "
              "[default: 100; 50 with a sparse codec]")
@click.option("--quorum", default=2, show_default=True, help="K: minimum learners merged per outer step.")
@click.option("--codec", default="int8", show_default=True, help="Codec of deltas and updates: int8, int4, bf16, "
              "fp16, fp32, or topk (sparse: chunked top-k with 2-bit values, for links of a few Mbit/s; docs/protocol.md "
              "§6).")
@click.option("--outer-lr", type=float, default=None, help="Outer (Nesterov SGD) learning rate.  [default: 0.2; "
              "1.0 with a sparse codec]")
@click.option("--outer-momentum", type=float, default=None, help="Outer Nesterov momentum.  [default: 0.9; 0 with "
              "a sparse codec, which needs 0]")
@click.option("--max-staleness", default=4, show_default=True, help="Deltas older than this many versions are dropped.")
@click.option("--max-tokens-per-step", default=1 << 24, show_default=True,
              help="The most tokens one learner may report for one inner step; an owner refuses a delta that "
              "claims more (set it to your largest learner's batch tokens).")
@click.option("--max-share", default=0.5, show_default=True,
              help="The largest share of one outer step any one learner's delta may have, whatever its claims.")
@click.option("--seed", default=0, show_default=True, help="Seed of the initial parameters.")
@click.option("--synchronous", is_flag=True, help="The synchronous baseline: every outer step waits for all "
              "--quorum learners (no grace window), learners wait for their merges and checkpoint at a barrier.")
@click.option("--allow", multiple=True, help="Hex public key allowed to join (repeatable); makes the run "
              "allowlist-only, and private: TLS on every connection, bound to each peer's key, and reads only for "
              "members. Without --allow the run is open: any key joins, over plain HTTP.")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_KEY, show_default=True,
              help="The creator's key file (created if missing); it signs the spec.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("run.spec"), show_default=True)
def init_run(name: str, task: str, preset: str, fragments: int, inner_steps: int | None, quorum: int, codec: str,
             outer_lr: float | None, outer_momentum: float | None, max_staleness: int, max_tokens_per_step: int,
             max_share: float, seed: int, synchronous: bool, allow: tuple[str, ...], key: Path, out: Path) -> None:
    """Write and sign a RunSpec: everything the swarm must agree on. Prints the run id."""
    from diloco.protocol.errors import ProtocolError

    from .train import new_run

    check_codec(codec)
    try:
        allowlist = tuple(bytes.fromhex(a) for a in allow)
    except ValueError:
        raise UserError("--allow takes hex public keys (as printed by `diloco-node keygen`)") from None
    model: dict = {"model": preset}
    if task.startswith("hf:"):
        from .tasks.hf import HFModel

        try:
            model, task = {"hf_config": HFModel.from_file(task.removeprefix("hf:")).config}, "hf"
        except ValueError as e:
            raise UserError(str(e)) from None
    try:
        genesis = new_run(load_identity(key), name, task=task, model=model, fragments=fragments,
                          inner_steps=inner_steps, quorum=quorum, codec=codec, outer_lr=outer_lr,
                          outer_momentum=outer_momentum, max_staleness=max_staleness, seed=seed,
                          max_tokens_per_step=max_tokens_per_step, max_share=max_share,
                          **({"synchronous": True, "grace_gamma": 0.0, "grace_cap_s": 0.0} if synchronous else {}),
                          membership="allowlist" if allowlist else "open", allowlist=allowlist)
    except (ProtocolError, ValueError, ImportError) as e:
        raise UserError(str(getattr(e, "reason", e))) from None
    genesis.save(out)
    click.echo(f"run_id: {genesis.spec.run_id.hex()}")
    click.echo(f"spec: {out}  (peers join with: diloco-node join --run {out} --peers HOST:PORT)")


@main.command(cls=ConfigCommand)
@click.option("--run", "--spec", "run_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The signed run spec written by `diloco-node init-run`. Under torchrun write --spec (torchrun "
              "takes --run for its own --run-path), or put `--` before `join`.")
@click.option("--listen", default="0.0.0.0:7000", show_default=True, help="HOST:PORT to serve on.")
@click.option("--announce", default=None, help="URL other peers should use (behind a 1:1 NAT, or when listening "
              "on 0.0.0.0).")
@click.option("--peers", multiple=True, help="HOST:PORT of any peer already in the swarm (repeatable). "
              "None: start a new swarm.")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Key file (created if missing). Default: a fresh key each start.")
@click.option("--data", default=None, help="This learner's own data: file:PATH (default: the run's task data).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="The inner steps' forward: bf16 autocast, or fp32. auto: bf16 with --device cuda, fp32 on the "
              "CPU. Parameters, deltas and versions stay fp32 either way.")
@click.option("--fsdp", is_flag=True, help="Under torchrun: shard the model over the ranks with FSDP2 "
              "(fully_shard per block) instead of replicating it with DDP; rank 0 keeps a full copy in host memory.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Save and resume local checkpoints here.")
@click.option("--checkpoint-every", default=200, show_default=True, help="Inner steps between checkpoints.")
@click.option("--client-mode", is_flag=True, help="Accept no inbound connections (behind NAT): push and pull "
              "only, own no fragment.")
@click.option("--region", default="", help="Free-form region label shown to other peers.")
@click.option("--steps", default=0, show_default=True, help="Stop after this many inner steps (0: run until Ctrl-C).")
@click.option("--progress-every", default=10, show_default=True)
@click.option("--eval-every", default=0, show_default=True, help="Evaluate on held-out data every N steps (0: at the end).")
@click.option("--json", "as_json", is_flag=True, help="Progress as JSON lines.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write every event as a JSON line to OUT/events.jsonl (for `diloco-node report OUT`).")
@click.option("--fast-membership", is_flag=True, hidden=True, help="Short member TTLs (localhost fleets).")
@click.option("--wait-for-peers", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Keep trying --peers for this many seconds (a fleet whose peers start at the same time).")
@click.option("--drain-s", default=25.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM, SIGINT or a --preemption-notice, leave within this many seconds: send the "
              "deltas due, publish the rounds this peer owns and hand each fragment (with its momentum) to its "
              "next owner, mark this member `left`, write a final checkpoint, exit 0. A second signal exits at "
              "once. Keep it below the time the platform waits before SIGKILL (systemd TimeoutStopSec, "
              "Kubernetes terminationGracePeriodSeconds).")
@click.option("--preemption-notice", type=click.Choice(["aws", "gcp"]), default=None,
              help="Also poll this cloud's instance metadata every 5 s for a spot interruption (aws, IMDSv2) or "
              "preemption (gcp) notice, and drain on it as on SIGTERM.")
@click.option("--metadata-url", default=None, hidden=True, envvar="DILOCO_METADATA_URL",
              help="Base URL of the instance metadata endpoint (tests: a fake one on loopback).")
@click.option("--slowdown", default=1.0, hidden=True, help="Straggler emulation factor.")
@click.option("--pace", "pace_s", default=0.0, hidden=True, help="Seconds every inner step lasts at least "
              "(an emulated fixed-speed chip; the chaos harness uses it).")
@click.option("--standalone", is_flag=True, hidden=True, help="Train alone, without a swarm (nominal rate).")
@click.option("--cert", "cert_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Membership certificate of --key (`diloco-node certify`): joins an allowlist run that does "
              "not list the key. Allowlist runs are private: TLS bound to each peer's key, signed reads; open "
              "runs stay on plain HTTP.")
@click.option("--operator-listen", default=None, metavar="HOST:PORT",
              help="Also serve the dashboard (GET /), /v1/status and /metrics here, over plain HTTP and with no "
              "key needed: for a browser or Prometheus where the peer's own port cannot serve them (a private "
              "run's port answers only members' signed reads; a --client-mode peer has none). Read-only, but it "
              "shows the peer's status to whoever reaches it: keep it on 127.0.0.1 or behind a firewall.")
def join(run_path: Path, listen: str, announce: str | None, peers: tuple[str, ...], key: Path | None,
         data: str | None, device: str, precision: str, fsdp: bool, checkpoint_dir: Path | None,
         checkpoint_every: int, client_mode: bool, region: str, steps: int, progress_every: int, eval_every: int, as_json: bool, out: Path | None, fast_membership: bool,
         wait_for_peers: float, slowdown: float, pace_s: float, standalone: bool, cert_path: Path | None,
         drain_s: float, preemption_notice: str | None, metadata_url: str | None,
         operator_listen: str | None) -> None:
    """Join a run as a learner (and syncer shard) and train the run's task."""
    from .learner import SyncTimeout
    from .preempt import DrainIncomplete
    from .swarm import JoinError
    from .tasks import CorpusError
    from .train import TrainOptions, train
    from .train_ranks import world_size

    genesis = _load_run(run_path)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda, but torch sees no CUDA device")
    if fsdp and world_size() == 1:
        raise UserError("--fsdp shards the model over torchrun's ranks: start join under "
                        "`torchrun --nproc-per-node N -m diloco.node join ...`")
    cfg = _swarm_config(listen, announce, peers, client_mode, region, fast_membership, wait_for_peers,
                        operator_listen)
    opts = TrainOptions(steps=steps, data=data, device=device, progress_every=progress_every,
                        eval_every=eval_every, json=as_json, checkpoint_dir=checkpoint_dir,
                        checkpoint_every=checkpoint_every if checkpoint_dir else 0, slowdown=slowdown,
                        pace_s=pace_s, standalone=standalone, fsdp=fsdp, out=_out_dir(out),
                        drain_s=drain_s, preemption_notice=preemption_notice, metadata_url=metadata_url,
                        precision=("bf16" if device == "cuda" else "fp32") if precision == "auto" else precision)
    # under torchrun only rank 0 is the swarm member: the others never sign anything, and must not race it
    # to create the key file
    identity = load_identity(key) if os.environ.get("RANK", "0") == "0" else Identity.generate()
    if cert_path is not None:
        cfg.certificate = _load_cert(cert_path, genesis.spec, identity, key)
    from .live import join_view

    try:
        with join_view(opts, _log_format()):  # (a terminal: a live view; else the lines emit prints)
            train(genesis, identity, cfg, opts)
        if world_size() > 1:
            _exit_rank()
    except (JoinError, SyncTimeout, DrainIncomplete) as e:
        raise UserError(str(e)) from None
    except CorpusError as e:
        raise UserError(f"--data {data}: {e}" if data else f"the run's task {genesis.spec.task}: {e}") from None


def _exit_rank() -> None:
    """A torchrun rank whose join finished (checkpoint written, process group destroyed) ends here, skipping
    the interpreter's finalization: there, an FSDP2 rank now and then aborted a finished job ("terminate called
    without an active exception": torch's threads torn down with the interpreter; README, Chaos)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _log_format() -> str:
    """The group's --log-format: "json" keeps stdout free of any live view."""
    return click.get_current_context().find_root().params.get("log_format", "text")


def _out_dir(out: Path | None) -> Path | None:
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out {out}: {e.strerror or e}") from None
    return out


def _load_cert(path: Path, spec, identity: Identity, key: Path | None):
    """The certificate at `path`, checked for this run, this key and now: one-line errors."""
    from diloco.coordinator.certs import Certificate
    from diloco.protocol.errors import ProtocolError

    try:
        cert = Certificate.load(path)
        if cert.peer != identity.public_key:
            whose = f"--key {key}" if key else "a fresh key (pass --key with the key it was issued to)"
            raise UserError(f"certificate {path} is for another key than {whose}")
        cert.verify(spec)
    except ProtocolError as e:
        raise UserError(f"certificate {path}: {e.reason}") from None
    return cert


def _public_key(value: str, flag: str) -> bytes:
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise UserError(f"{flag} {value[:80]!r} is not a public key: 64 hex digits, as `diloco-node keygen` prints")
    return key


def _creator(key: Path, spec) -> Identity:
    """The run creator's existing key (never created here)."""
    try:
        ident = Identity.load(key)
    except KeyFileError as e:
        raise UserError(str(e)) from None
    if ident.public_key != spec.creator:
        raise UserError(f"--key {key} is not this run's creator's key (the spec was signed by another key)")
    if spec.membership != "allowlist":
        raise UserError("this run is open (it admits every key): certificates and amendments are for runs "
                        "created with --allow")
    return ident


@main.command()
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The signed run spec (`diloco-node init-run`); an allowlist run.")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_KEY, show_default=True,
              help="The run creator's key file (the one that signed the spec).")
@click.option("--peer", "peer_hex", required=True, help="Hex public key to admit (as `diloco-node keygen` prints).")
@click.option("--days", required=True, type=click.FloatRange(min=0, min_open=True),
              help="Days the certificate is valid from now (a clock skew of 60 s is allowed at both ends).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the certificate. Default: PEERID12.cert in the current directory.")
def certify(run_path: Path, key: Path, peer_hex: str, days: float, out: Path | None) -> None:
    """Admit a key to an allowlist run without a new run id: write a membership certificate.

    The creator signs [run id, peer key, not_before, not_after] (docs/protocol.md §7.18). The peer joins with
    `diloco-node join --run SPEC --key ITS_KEY --cert FILE`, and shows the certificate to the others, which
    admit it until it expires or an amendment (`diloco-node amend --revoke`) revokes the key.
    """
    from datetime import UTC, datetime

    from diloco.coordinator.certs import Certificate
    from diloco.protocol.identity import peer_id_of

    genesis = _load_run(run_path)
    peer = _public_key(peer_hex, "--peer")
    try:
        cert = Certificate.issue(_creator(key, genesis.spec), genesis.spec, peer, days)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = out or Path(f"{peer_id_of(peer)[:12]}.cert")
    try:
        cert.save(out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    until = datetime.fromtimestamp(cert.not_after, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    click.echo(f"peer_id: {peer_id_of(peer)}")
    click.echo(f"valid_until: {until}")
    click.echo(f"certificate: {out}  (the peer joins with: diloco-node join --run {run_path} --key ITS_KEY "
               f"--cert {out} --peers HOST:PORT)")


@main.command()
@click.option("--run", "run_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The signed run spec (`diloco-node init-run`); an allowlist run.")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_KEY, show_default=True,
              help="The run creator's key file (the one that signed the spec).")
@click.option("--revoke", multiple=True, help="Hex public key to refuse from now on, listed or certified "
              "(repeatable).")
@click.option("--allow", multiple=True, help="Hex public key to admit as if the spec listed it (repeatable).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The amendment file: read as the previous amendment if it exists, then replaced by the new "
              "one. Default: SPEC.amend next to the spec.")
@click.option("--peers", multiple=True, help="HOST:PORT (or URL) of a running peer of the run (repeatable): "
              "the amendment is posted to the first that takes it, which relays it into the DHT.")
def amend(run_path: Path, key: Path, revoke: tuple[str, ...], allow: tuple[str, ...], out: Path | None,
          peers: tuple[str, ...]) -> None:
    """Revoke or add keys of an allowlist run without a new run id: sign the next amendment of its spec.

    An amendment holds every change since the genesis (the previous one's lists with this command's applied)
    and a sequence number one above the previous; peers keep the highest. Every peer reads it from the DHT at
    its next member poll (2 s), without a restart: from then on a revoked key's messages get 403 and its
    member record is ignored (so it owns nothing). Without --revoke or --allow, the existing file is posted
    again. Without --peers, only the file is written.
    """
    import asyncio

    from diloco.coordinator.certs import Amendment
    from diloco.coordinator.membership import CertificateRefused, post_amendment
    from diloco.protocol.errors import ProtocolError

    genesis = _load_run(run_path)
    creator = _creator(key, genesis.spec)
    out = out or run_path.with_name(run_path.name + ".amend")
    previous = None
    if out.exists():
        try:
            previous = Amendment.load(out)
            previous.verify(genesis.spec)
        except ProtocolError as e:
            raise UserError(f"previous amendment {out}: {e.reason}") from None
    revoked = [_public_key(k, "--revoke") for k in revoke]
    allowed = [_public_key(k, "--allow") for k in allow]
    if revoked or allowed:
        try:
            amendment = Amendment.issue(creator, genesis.spec, revoke=revoked, allow=allowed, previous=previous)
        except (ValueError, ProtocolError) as e:
            raise UserError(str(getattr(e, "reason", e))) from None
        amendment.save(out)
    elif previous is None:
        raise UserError(f"nothing to amend: pass --revoke or --allow (there is no {out} to post again)")
    else:
        amendment = previous
    click.echo(f"amendment: {out}  seq {amendment.seq}, {len(amendment.revoke)} keys revoked, "
               f"{len(amendment.allow)} added")
    if not peers:
        return
    try:
        held = asyncio.run(post_amendment(creator, genesis.spec, amendment, [_peer_url(p) for p in peers]))
    except CertificateRefused as e:
        raise UserError(str(e)) from None
    if held is None:
        raise UserError("no peer took the amendment (none answered); try other --peers, or later")
    if held > amendment.seq:
        raise UserError(f"the swarm holds amendment {held}, newer than {out} (seq {amendment.seq}): amend from "
                        "the newest file, or the peers keep theirs")
    click.echo(f"published: the swarm holds amendment {held}")


@main.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print the raw /v1/status JSON.")
@click.option("--run", "run_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The run's spec: for an allowlist (private) run, whose peers speak TLS and answer only reads "
              "a member signs (with --key).")
@click.option("--key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A member's key file, to sign the read of a private run.")
def status(url: str, as_json: bool, run_path: Path | None, key: Path | None) -> None:
    """Print a peer's view of the swarm (GET URL/v1/status). A private run's peer answers only a member:
    give --run and --key."""
    import asyncio
    import json as _json

    from diloco.protocol.errors import ProtocolError
    from diloco.protocol.reads import ReadSigner
    from diloco.protocol.transport import PeerClient, RemoteError, TransportError

    spec = _load_run(run_path).spec if run_path is not None else None
    private = spec is not None and spec.membership == "allowlist"
    if private and key is None:
        raise UserError("this run is private: give --key with a member's key file to sign the read")
    signer = ReadSigner(load_identity(key), spec.run_id) if spec is not None and private and key else None

    async def fetch() -> dict:
        async with PeerClient(retries=1, tls=private, read_signer=signer) as client:
            return _json.loads(await client.request("GET", _peer_url(url), "/v1/status", deadline_s=10))

    try:
        st = asyncio.run(fetch())
    except RemoteError as e:
        hint = " (a private run's peer: give --run and --key of a member)" if e.status == 403 else ""
        raise UserError(f"cannot get status from {url}: {e}{hint}") from None
    except (TransportError, ProtocolError) as e:
        hint = "" if private else " (an https:// peer of a private run: give --run and --key)"
        raise UserError(f"cannot get status from {url}: {e}{hint if url.startswith('https') else ''}") from None
    if as_json:
        click.echo(_json.dumps(st, indent=2))
        return
    click.echo(f"peer {st['peer_id'][:12]} in run {st['run_name']} ({st['run_id'][:12]}), step {st['step']}, "
               f"loss {st['loss']}, {'synced' if st['synced'] else 'syncing'}")
    click.echo(f"members ({len(st['members'])}):")
    for m in st["members"]:
        click.echo(f"  {m['peer_id'][:12]} {m['url'] or '(client mode)'} step {m['step']} {m['region']}")
    click.echo("fragments:")
    for f in st["fragments"]:
        roles = ", ".join(r[:8] for r in f["roles"])
        click.echo(f"  {f['p']}: version {f['version']}  owner/replicas [{roles}]  outer steps here {f['outer_steps']}")


@main.command()
@click.option("--peers", default=3, show_default=True, type=click.IntRange(min=1),
              help="N: learner processes to start on this machine (each also hosts a syncer shard).")
@click.option("--steps", default=600, show_default=True, type=click.IntRange(min=1),
              help="Inner steps each learner trains; the demo ends when all have finished.")
@click.option("--task", default="markov", show_default=True, help="Built-in task: markov, kjv or file:PATH.")
@click.option("--inner-steps", default=50, show_default=True, type=click.IntRange(min=1),
              help="H: inner steps between two deltas of a fragment (short, so a short demo has many outer steps).")
@click.option("--fragments", default=4, show_default=True, type=click.IntRange(min=1),
              help="P: fragments the model is cut into.")
@click.option("--codec", default="int8", show_default=True, help="Codec of deltas and updates (int8, int4, bf16, "
              "fp16, fp32, topk).")
@click.option("--workdir", "--out", "workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the run spec, keys and the learners' logs go. Default: a fresh temporary directory "
              "(printed at the start).")
@click.option("--progress-every", default=10, show_default=True, type=click.IntRange(min=1),
              help="Inner steps between two progress reports of a learner.")
@click.option("--timeout", "timeout_s", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Stop with an error if the learners have not all finished after this many seconds (0: no limit).")
@click.option("--json", "as_json", is_flag=True,
              help="Plain progress lines instead of the live table, and a JSON summary as the last line: "
              "peers, final_loss, eval_loss, outer_steps, goodput, bytes_sent, wall_s.")
def demo(peers: int, steps: int, task: str, inner_steps: int, fragments: int, codec: str, workdir: Path | None,
         progress_every: int, timeout_s: float, as_json: bool) -> None:
    """Run a real swarm of N learners on this machine, with live progress, then print a summary.

    Writes a fresh run spec and keys into --workdir, starts one `diloco-node join` process per learner
    (the first opens the swarm, the others join it through the first one's URL), shows every learner's step,
    loss, speed, fragment versions, peers seen and traffic (a live table on a terminal, plain lines
    otherwise) and ends when all have trained --steps inner steps. Ctrl-C stops the learners (SIGINT,
    then SIGKILL after 5 s); no process is left behind.

    Goodput in the summary is the share of inner steps whose progress reached a published version,
    Σ merged_steps / (P · Σ steps).
    """
    import json as _json

    from .demo import DemoError, DemoOptions, run_demo

    check_codec(codec)
    opts = DemoOptions(peers=peers, steps=steps, task=task, inner_steps=inner_steps, fragments=fragments,
                       codec=codec, workdir=workdir, json=as_json, progress_every=progress_every,
                       timeout_s=timeout_s, live=False if _log_format() == "json" else None)
    try:
        runner, summary, interrupted = run_demo(opts)
    except DemoError as e:
        for line in e.details:
            click.echo(line, err=True)
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"demo working directory: {e}") from None
    for line in runner.report(summary, interrupted):
        click.echo(line)
    if as_json:
        click.echo(_json.dumps(summary))
    if interrupted:
        click.echo("interrupted: the learners were stopped before finishing", err=True)
        sys.exit(130)


@main.command()
@click.argument("run_dir", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the PNG files go. Default: DIR/report.")
def report(run_dir: Path, out: Path | None) -> None:
    """Draw PNG plots of a run directory: loss and eval loss against wall time and tokens, goodput, bytes per
    inner step, and a histogram of the learners' staleness.

    DIR is what `join --out`, `demo --out` or `chaos --out` wrote (the learners' JSON event lines); how each
    figure is computed: diloco.node.report. Prints every file written, and every plot skipped for lack of data.
    Needs matplotlib (`pip install 'diloco-node[plots]'`).
    """
    from .report import ReportError, describe, make_report

    try:
        result = make_report(run_dir, out)
    except ReportError as e:
        raise UserError(str(e)) from None
    for line in describe(result):
        click.echo(line)


@main.command("simulate")
@click.option("--chips", default="150000,300000,600000,1200000,2400000", show_default=True,
              help="N: cluster sizes in chips, comma-separated (150k and 1.2M are accepted).")
@click.option("--learners", default="2,4,8,16", show_default=True,
              help="M: learners the chips are split into, comma-separated.")
@click.option("--mtbi-years", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Per-chip mean time between interruptions in years (inf: no failures). Default: 1, the "
              "paper's scenario.")
@click.option("--profile", "profile_name", type=click.Choice(["paper", "localhost"]), default="paper",
              show_default=True, help="paper: learners are elastic jobs of TPU slices, Decoupled DiLoCo's setup "
              "(diloco.node.simulate_elastic); localhost: a failure stops its whole learner, as in `chaos` "
              "(diloco.node.simulate_restart). Every value and its source: docs/chaos.md.")
@click.option("--param", "overrides", multiple=True, metavar="NAME=VALUE",
              help="Override a cost of the profile, e.g. --param return_s=300 (repeatable; the names are the "
              "fields of the profile's ElasticParams or SimParams).")
@click.option("--des", is_flag=True, help="Run the seeded discrete-event simulation instead of the exact "
              "expectation (slower; a cross-check).")
@click.option("--seed", default=0, show_default=True, help="Seed of --des.")
@click.option("--json", "as_json", is_flag=True,
              help="Also print a JSON last line: {\"rows\": [{mode, chips, learners, goodput}], \"params\": {...}}.")
def simulate_cmd(chips: str, learners: str, mtbi_years: float | None, profile_name: str, overrides: tuple[str, ...],
                 des: bool, seed: int, as_json: bool) -> None:
    """Predict fleet goodput of dp, elastic dp and decoupled learners as chips fail.

    N chips (M learners of N/M for decoupled), every chip interrupted at random with the given mean. Profile
    paper: dp waits for the failed chips to return, then regrows; dp_elastic drops the failed slice, goes on
    with the rest and takes it back later; decoupled: each learner is such an elastic job and only its own
    failures cost it. Profile localhost: a failure stops its learner (dp: everyone, from the last checkpoint).
    Goodput is the share of allocated chip-time spent on steps that survive.
    """
    import json as _json

    from .simulate import (
        DEFAULT_MTBI_YEARS,
        YEAR_S,
        format_table,
        params_json,
        parse_counts,
        profile,
        table,
        with_overrides,
    )

    try:
        chip_counts, learner_counts = parse_counts(chips), parse_counts(learners)
        params = with_overrides(profile(profile_name), overrides)
    except ValueError as e:
        raise UserError(str(e)) from None
    if min(chip_counts) < max(learner_counts):
        raise UserError(f"--chips {min(chip_counts)} is fewer than --learners {max(learner_counts)}; "
                        "every learner needs at least one chip")
    mtbi_s = (DEFAULT_MTBI_YEARS if mtbi_years is None else mtbi_years) * YEAR_S
    try:
        rows = table(chip_counts, learner_counts, mtbi_s, params, des=des, seed=seed)
    except ValueError as e:  # --des with an infinite horizon
        raise UserError(f"{e}; pass --param horizon_s=SECONDS") from None
    for line in format_table(rows, mtbi_s, params, des):
        click.echo(line)
    if as_json:
        click.echo(_json.dumps({"rows": rows, "params": params_json(params, mtbi_s, des)}))


@main.command()
@click.option("--peers", default=4, show_default=True, type=click.IntRange(min=2), help="M: learner processes.")
@click.option("--minutes", default=5.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Length of each mode's run (and of the no-failure run).")
@click.option("--mtbf", "mtbf_s", default=130.0, show_default=True, type=click.FloatRange(min=0),
              help="Mean seconds between failures of each learner, counted while it is up (0: no faults).")
@click.option("--downtime", "downtime_s", default=3.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds a killed learner stays down before it is restarted.")
@click.option("--mode", default="both", show_default=True, type=click.Choice(["decoupled", "sync", "both"]))
@click.option("--seed", default=0, show_default=True, help="Seed of the fault schedule.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the event log, per-learner metrics, summary and plots go (default: a fresh temp dir).")
@click.option("--pace", "pace_s", default=0.12, show_default=True, type=click.FloatRange(min=0),
              help="Seconds per inner step of every learner (an emulated fixed-speed chip).")
@click.option("--inner-steps", default=30, show_default=True, type=click.IntRange(min=1), help="H of both runs.")
@click.option("--checkpoint-every", default=100, show_default=True, type=click.IntRange(min=1),
              help="Inner steps between the learners' checkpoints (what the sync baseline rolls back to).")
@click.option("--owner-every", default=3, show_default=True, type=click.IntRange(min=0),
              help="Every N-th fault is aimed at whoever owns a fragment at that moment (0: none).")
@click.option("--straggler", multiple=True, metavar="SLOT:FACTOR",
              help="Make learner SLOT's steps FACTOR times slower (repeatable).")
@click.option("--throttle", multiple=True, metavar="SLOT:MBIT",
              help="Limit the link into learner SLOT to MBIT Mbit/s each way (repeatable).")
@click.option("--no-baseline", is_flag=True, help="Skip the no-failure run (no no_failure_eval_loss).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")
def chaos(peers: int, minutes: float, mtbf_s: float, downtime_s: float, mode: str, seed: int, out: Path | None,
          pace_s: float, inner_steps: int, checkpoint_every: int, owner_every: int, straggler: tuple[str, ...],
          throttle: tuple[str, ...], no_baseline: bool, as_json: bool) -> None:
    """Kill and restart learners on a seeded schedule; compare decoupled with the synchronous baseline.

    Runs the same fleet on the same fault schedule in each mode, then once without faults, and reports goodput
    (docs/architecture.md §10, from the learners' own counters), eval loss at equal tokens, and the invariants (version
    regressions, unloadable checkpoints, lost accepted updates), with the fleet simulator's figures: its
    prediction from the calibration alone (predicted_goodput) and its replay of the run's own kill schedule with
    the costs measured in it (replayed_goodput). Writes events.jsonl, metrics.jsonl, summary.json and PNG plots
    to --out.
    """
    import json as _json

    from .chaos import ChaosError
    from .chaos_run import PREDICTION_KEYS, RESULT_KEYS, ChaosOptions, run_chaos

    slow = _slot_values("--straggler", "SLOT:FACTOR", straggler, peers, minimum=1.0)
    links = _slot_values("--throttle", "SLOT:MBIT", throttle, peers, minimum=0.01)
    opts = ChaosOptions(peers=peers, minutes=minutes, mtbf_s=mtbf_s, downtime_s=downtime_s, mode=mode, seed=seed,
                        out=out, json=as_json, pace_s=pace_s, inner_steps=inner_steps,
                        checkpoint_every=checkpoint_every, owner_every=owner_every, stragglers=slow, throttle=links,
                        no_failure=not no_baseline)
    try:
        result = run_chaos(opts, say=lambda line: click.echo(line, err=as_json))
    except (ChaosError, RuntimeError) as e:
        raise UserError(str(e)) from None
    modes = [m for m in ("decoupled", "sync") if m in result]
    click.echo("", err=as_json)
    click.echo(f"{'':24}" + "".join(f"{m:>14}" for m in modes), err=as_json)
    for key in (*RESULT_KEYS, *PREDICTION_KEYS):
        click.echo(f"{key:24}" + "".join(f"{_fmt(result[m].get(key)):>14}" for m in modes), err=as_json)
    if "no_failure_eval_loss" in result:
        click.echo(f"no-failure eval loss at the decoupled run's merged tokens: {_fmt(result['no_failure_eval_loss'])}",
                   err=as_json)
    click.echo(f"output: {result['out']}", err=as_json)
    if as_json:
        keep = {m: {k: result[m][k] for k in (*RESULT_KEYS, *PREDICTION_KEYS)} for m in modes}
        if "no_failure_eval_loss" in result:
            keep["no_failure_eval_loss"] = result["no_failure_eval_loss"]
        click.echo(_json.dumps(keep))


def _slot_values(flag: str, form: str, items: tuple[str, ...], peers: int, minimum: float) -> dict[int, float]:
    """Parse repeated SLOT:VALUE options."""
    out: dict[int, float] = {}
    for item in items:
        try:
            slot, value = item.split(":")
            out[int(slot)] = float(value)
        except ValueError:
            raise UserError(f"{flag} {item!r}: expected {form}, e.g. 2:1.5") from None
        if not 0 <= int(slot) < peers or float(value) < minimum:
            raise UserError(f"{flag} {item!r}: SLOT must be 0..{peers - 1} and the value >= {minimum:g}")
    return out


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def load_identity(path: Path | None) -> Identity:
    """Load a key for a command, turning key-file problems into one-line user errors."""
    try:
        return Identity.load_or_generate(path)
    except KeyFileError as e:
        raise UserError(str(e)) from None


if __name__ == "__main__":
    main()
