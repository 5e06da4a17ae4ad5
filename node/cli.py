"""The `diloco-node` command line: every subcommand a user types lives here, thin over the Python API.

Errors a user can cause print one line saying what happened and what to do, never a traceback.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from diloco.protocol.identity import Identity, KeyFileError

from . import __version__

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
    if not sep or not port.isdigit() or not host or int(port) > 65535:
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


def load_identity(path: Path | None) -> Identity:
    """Load a key for a command, turning key-file problems into one-line user errors."""
    try:
        return Identity.load_or_generate(path)
    except KeyFileError as e:
        raise UserError(str(e)) from None


if __name__ == "__main__":
    main()
