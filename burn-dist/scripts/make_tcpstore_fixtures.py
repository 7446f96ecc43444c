#!/usr/bin/env python3
"""Records the bytes of torch's TCPStore protocol for burn-dist's client tests.

A real `torch.distributed.TCPStore` client talks to a real TCPStore server through a recording
proxy; every operation's bytes, in each direction, are written to a fixture file. The Rust test
(`burn-dist/src/rendezvous/torch_store_tests.rs`) replays the server's side from the fixture on a real socket and
checks that burn-dist's client sends exactly the bytes torch's client sent.

Run once per torch upgrade (the tests never need Python):

    python burn-dist/scripts/make_tcpstore_fixtures.py burn-dist/tests/fixtures/tcpstore

It writes one file per server backend: `libuv.txt` (torch's default since 2.4, what torchrun's
agent serves) and `classic.txt` (`use_libuv=False`).

Fixture format, one item per line:
    # comment
    == <operation>        a new operation, which the test performs too: `connect`,
                          `set KEY VALUE`, `get KEY VALUE`, `add KEY DELTA RESULT`,
                          `check KEY,.. ready|not-ready`,
                          `set-if-absent KEY VALUE STANDING` (torch's `compare_set` with an
                          empty expected value; STANDING is the value it answers), `wait KEY,.. MILLISECONDS done|timeout`
                          (keys after the prefix below, values in hex, `-` for empty)
    > <hex>               bytes the client sent
    < <hex>               bytes the server answered
    ~ <milliseconds>      the server answered only after this pause
"""

import datetime
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

# The keys burn-dist uses under torchrun: one prefix per run id and restart. torch's own client
# puts "/" in front of every key, so on the wire they read "/burn-dist/none/attempt_0/..."; burn-dist's
# client sends that full key itself (so torch tools see the same keys).
PREFIX = "burn-dist/none/attempt_0/"
SETTLE_S = 0.15


class Recorder:
    """A TCP proxy that logs every chunk with its direction."""

    def __init__(self, server_port):
        self.server_port = server_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.items = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.server_port))
        for a, b, tag in ((client, server, ">"), (server, client, "<")):
            threading.Thread(target=self._pump, args=(a, b, tag), daemon=True).start()

    def _pump(self, src, dst, tag):
        while True:
            chunk = src.recv(1 << 16)
            if not chunk:
                return
            with self.lock:
                self.items.append((tag, chunk))
            dst.sendall(chunk)

    def note(self, line):
        with self.lock:
            self.items.append(("raw", line))

    def take(self):
        """The items since the last call, with consecutive chunks of one direction merged."""
        time.sleep(SETTLE_S)
        with self.lock:
            items, self.items = self.items, []
        merged = []
        for tag, data in items:
            if tag != "raw" and merged and merged[-1][0] == tag:
                merged[-1] = (tag, merged[-1][1] + data)
            else:
                merged.append((tag, data))
        return merged


def record(use_libuv):
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout, wait_for_workers=False, use_libuv=use_libuv
    )
    proxy = Recorder(server.port)
    sections = []

    def section(name):
        sections.append((name, proxy.take()))

    client = dist.TCPStore(
        "127.0.0.1", proxy.port, None, False, timeout, wait_for_workers=False
    )
    section("connect")

    def k(name):
        return PREFIX + name

    client.set(k("addr/0"), b"127.0.0.1:41000")
    section(f"set addr/0 {b'127.0.0.1:41000'.hex()}")
    client.set(k("bin"), bytes([0, 1, 2, 255, 254, 0]))
    section("set bin 000102fffe00")
    client.set(k("empty"), b"")
    section("set empty -")

    assert client.get(k("addr/0")) == b"127.0.0.1:41000"
    section(f"get addr/0 {b'127.0.0.1:41000'.hex()}")
    assert client.get(k("bin")) == bytes([0, 1, 2, 255, 254, 0])
    section("get bin 000102fffe00")
    assert client.get(k("empty")) == b""
    section("get empty -")

    assert client.add(k("count"), 5) == 5
    section("add count 5 5")
    assert client.add(k("count"), -2) == 3
    section("add count -2 3")
    assert client.get(k("count")) == b"3"
    section(f"get count {b'3'.hex()}")

    assert client.check([k("addr/0")])
    section("check addr/0 ready")
    assert not client.check([k("addr/0"), k("addr/1")])
    section("check addr/0,addr/1 not-ready")

    # compare_set with an empty expected value: set-if-absent, answered with the value that stands.
    assert client.compare_set(k("failure"), b"", b"first") == b"first"
    section(f"set-if-absent failure {b'first'.hex()} {b'first'.hex()}")
    assert client.compare_set(k("failure"), b"", b"second") == b"first"
    section(f"set-if-absent failure {b'second'.hex()} {b'first'.hex()}")
    assert client.get(k("failure")) == b"first"
    section(f"get failure {b'first'.hex()}")

    client.wait([k("addr/0"), k("bin")], datetime.timedelta(seconds=5))
    section("wait addr/0,bin 5000 done")
    try:
        client.wait([k("addr/1")], datetime.timedelta(milliseconds=300))
        raise AssertionError("the wait should have timed out")
    except dist.DistStoreError:
        pass
    section("wait addr/1 300 timeout")
    # After a cancelled wait the connection is still in step.
    assert client.check([k("bin")])
    section("check bin ready")

    # A wait that another client ends: the answer comes only when the key is set.
    other = dist.TCPStore("127.0.0.1", server.port, None, False, timeout, wait_for_workers=False)
    delay_ms = 200

    def set_later():
        time.sleep(delay_ms / 1000)
        proxy.note(f"~ {delay_ms}")
        other.set(k("late"), b"x")

    setter = threading.Thread(target=set_later)
    setter.start()
    client.wait([k("late")], datetime.timedelta(seconds=5))
    setter.join()
    section("wait late 5000 done")

    backend = "libuv" if use_libuv else "classic"
    lines = [
        f"# torch {torch.__version__} TCPStore, {backend} server backend.",
        "# Made by burn-dist/scripts/make_tcpstore_fixtures.py from a real TCPStore; do not edit.",
    ]
    for name, items in sections:
        lines.append(f"== {name}")
        for tag, data in items:
            lines.append(data if tag == "raw" else f"{tag} {data.hex()}")
    return "\n".join(lines) + "\n"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "burn-dist/tests/fixtures/tcpstore"
    os.makedirs(out, exist_ok=True)
    for use_libuv in (True, False):
        name = "libuv.txt" if use_libuv else "classic.txt"
        text = record(use_libuv)
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
        print(f"wrote {os.path.join(out, name)}")


if __name__ == "__main__":
    main()
