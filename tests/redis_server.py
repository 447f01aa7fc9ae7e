"""The Redis server the tier tests run against, and the means to stop and restart it.

`.ci/run` starts one with ``scripts/redis-test-server.sh`` and exports its URL as
``OMNICACHE_REDIS_URL``; without that variable the tests start their own the same
way (when ``redis-server`` is installed). Under ``CI=true`` a server that cannot
be reached or started fails the run: these tests never skip there.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "redis-test-server.sh"
INSTALL_HINT = "install it with: apt-get install redis-server"


class RedisServer:
    """A redis-server started from a config file, which it can stop and start again."""

    def __init__(self, url: str, config_file: str, owned_dir: Path | None) -> None:
        self.url = url
        self.config_file = config_file
        self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        # The folder of a server these tests started (stopped at the end).
        self.owned_dir = owned_dir

    @classmethod
    def start_private(cls, folder: Path) -> RedisServer:
        """Starts a new server whose config, pid and log live in ``folder``."""
        result = subprocess.run(
            [str(SCRIPT), "start", str(folder)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"redis-test-server.sh start failed: {result.stderr.strip()}")
        return cls(result.stdout.strip(), str(folder / "redis.conf"), folder)

    @classmethod
    def attach(cls, url: str) -> RedisServer:
        """The server at ``url``, started from a config file (as by the script)."""
        info = redis.Redis.from_url(url, socket_timeout=2).info("server")
        config_file = str(info.get("config_file") or "")
        if not config_file:
            raise RuntimeError(f"the server at {url} was started without a config file")
        return cls(url, config_file, None)

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
        """Starts the server again from its config file, and waits until it answers."""
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(f"redis-server not found; {INSTALL_HINT}")
        subprocess.run([executable, self.config_file], check=True, capture_output=True)
        deadline = time.monotonic() + 10
        while not self.is_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis at {self.url} did not start from {self.config_file}")
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
    if shutil.which("redis-server") is None:
        return f"redis-server not found; {INSTALL_HINT}"
    try:
        return RedisServer.start_private(tmp_dir)
    except RuntimeError as exc:
        return str(exc)


def _free_cluster_port() -> int:
    """A free port p <= 55535 whose bus port p + 10000 is free too (Redis Cluster's rule)."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def start_cluster(folder: Path, num_nodes: int = 3) -> list[RedisServer]:
    """A Redis Cluster of ``num_nodes`` masters on loopback, slots spread evenly."""
    nodes: list[RedisServer] = []
    try:
        for index in range(num_nodes):
            node_dir = folder / f"node{index}"
            node_dir.mkdir(parents=True)
            port = _free_cluster_port()
            config = node_dir / "redis.conf"
            config.write_text(
                f"bind 127.0.0.1\nport {port}\ndaemonize yes\npidfile {node_dir}/redis.pid\n"
                f'logfile {node_dir}/redis.log\ndir {node_dir}\nsave ""\nappendonly no\n'
                f"cluster-enabled yes\ncluster-config-file {node_dir}/nodes.conf\n"
            )
            node = RedisServer(f"redis://127.0.0.1:{port}/0", str(config), node_dir)
            node.start()
            nodes.append(node)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
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
