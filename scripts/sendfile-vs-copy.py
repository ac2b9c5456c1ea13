#!/usr/bin/env python3
"""What sending file data by reference saves a target, measured on this machine: chunks (128 KiB
unless told) at random offsets of a cached file sent over a loopback TCP socket, each behind a
48-byte header (an iSCSI Data-In's basic header segment), two ways:

- copy:     pread into a buffer, then one send of header and buffer (what targetd does today
            for a file LUN through the page cache: two copies, page cache to buffer to socket);
- sendfile: the header with MSG_MORE, then sendfile from the file (the socket takes
            references to the page cache's pages; on loopback the receiver copies from them).

The sender runs on CPU 1 and the receiver, draining, on CPU 0. Prints the sender's CPU time
per chunk (thread CPU time, which on loopback includes the kernel's delivery to the receiving
socket) and the wall time. Run each mode several times, alternating; compare the ratio.

    scripts/sendfile-vs-copy.py FILE [COUNT [CHUNK_KIB]]   # FILE: at least one chunk, cached
"""
import os
import random
import socket
import sys
import time

HEADER = b"\0" * 48


def run(mode, path, count, chunk):
    fd = os.open(path, os.O_RDONLY)
    chunks = os.fstat(fd).st_size // chunk
    if chunks == 0:
        sys.exit(f"{path} is smaller than {chunk // 1024} KiB")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        os.sched_setaffinity(0, {0})
        conn = socket.create_connection(("127.0.0.1", port))
        sink = memoryview(bytearray(1 << 20))
        while conn.recv_into(sink):
            pass
        os._exit(0)
    os.sched_setaffinity(0, {1})
    sock, _ = listener.accept()
    rng = random.Random(1)
    offsets = [rng.randrange(chunks) * chunk for _ in range(count)]
    for o in offsets:
        os.pread(fd, 1, o)
    whole = memoryview(bytearray(len(HEADER) + chunk))
    whole[: len(HEADER)] = HEADER
    payload = whole[len(HEADER):]
    out = sock.fileno()
    cpu, wall = time.thread_time(), time.time()
    for o in offsets:
        if mode == "copy":
            os.preadv(fd, [payload], o)
            sock.sendall(whole)
        else:
            sock.send(HEADER, socket.MSG_MORE)
            sent = 0
            while sent < chunk:
                sent += os.sendfile(out, fd, o + sent, chunk - sent)
    cpu, wall = time.thread_time() - cpu, time.time() - wall
    sock.close()
    os.waitpid(child, 0)
    os.close(fd)
    print(f"{mode:8} {count} x {chunk // 1024} KiB: sender CPU {1e6 * cpu / count:.1f} us per chunk, "
          f"wall {1e6 * wall / count:.1f} us")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    chunk = (int(sys.argv[3]) if len(sys.argv) > 3 else 128) * 1024
    for _ in range(3):
        run("copy", path, count, chunk)
        run("sendfile", path, count, chunk)


if __name__ == "__main__":
    main()
