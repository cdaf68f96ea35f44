"""Experiment: jetflow.cli with a daemon thread calling glibc malloc_trim(0) every TRIM_EVERY seconds."""
import ctypes
import os
import sys
import threading
import time

libc = ctypes.CDLL("libc.so.6")
every = float(os.environ.get("TRIM_EVERY", "1"))
def loop():
    while True:
        time.sleep(every)
        libc.malloc_trim(0)
threading.Thread(target=loop, daemon=True).start()
from jetflow.cli import main  # noqa: E402  (after the thread: it trims from the first import on)
sys.argv = ["jetflow"] + sys.argv[1:]
sys.exit(main())
