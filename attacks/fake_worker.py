"""A hostile worker speaking the wire format (what a candidate with arbitrary code in the worker can do to its
pipes and its own process). Mode from FAKE_MODE. No torch: frames written by hand."""
import json
import os
import signal
import struct
import sys
import threading
import time

MAGIC = b"OBW1"


def frame(header: dict | str) -> bytes:
    head = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + struct.pack("<Q", 0)


def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def read_frame(r):
    def exactly(n):
        out = b""
        while len(out) < n:
            chunk = os.read(r, n - len(out))
            if not chunk:
                sys.exit(0)
            out += chunk
        return out
    exactly(4)
    (n,) = struct.unpack("<I", exactly(4))
    head = json.loads(exactly(n))
    (m,) = struct.unpack("<Q", exactly(8))
    exactly(m)
    return head


def main():
    r, w = int(sys.argv[1]), int(sys.argv[2])
    mode = os.environ.get("FAKE_MODE", "")
    os.write(w, frame({"ready": os.getpid()}))
    first = True
    while True:
        head = read_frame(r)
        if mode == "deepjson":
            os.write(w, frame('{"a":' + "[" * 100000 + "]" * 100000 + "}"))
        elif mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "flood":
            block = b"x" * (1 << 20)
            for _ in range(200):
                os.write(2, block)
            os.write(w, frame({"done": 1}))
        elif mode == "prequeue":  # answer the first request 20 times over, then do the real work unmeasured
            if first:
                os.write(w, frame({"repeated": 0}) * 20)
            burn(0.5)
        elif mode == "threadwork":  # the work runs on a helper thread; the main thread sleeps in join()
            th = threading.Thread(target=burn, args=(0.5,))
            th.start()
            th.join()
            os.write(w, frame({"repeated": 0}))
        elif mode == "honestwork":
            burn(0.5)
            os.write(w, frame({"repeated": 0}))
        first = False


main()
