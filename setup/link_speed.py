"""One TCP stream between two hosts, to measure the link: `recv ADDR PORT` listens, prints
"listening", then after the sender is done prints the bytes it got and the times of the first and
last byte; `send ADDR PORT NBYTES` sends NBYTES of zeros. setup/doctor.sh --link and the
simulated-cluster tests measure links with it. Plain Python, no third-party module: it runs on any
host with python3."""

import socket
import sys
import time


def recv(addr: str, port: int) -> None:
    server = socket.create_server((addr, port))
    server.settimeout(60)
    print("listening", flush=True)
    conn, _ = server.accept()
    conn.settimeout(60)
    got, first = 0, None
    while chunk := conn.recv(1 << 20):
        first = first or time.time()
        got += len(chunk)
    print(got, first, time.time(), flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    conn = socket.create_connection((addr, port), timeout=30)
    conn.sendall(bytes(nbytes))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)


if __name__ == "__main__":
    role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    recv(addr, port) if role == "recv" else send(addr, port, int(sys.argv[4]))
