"""Hold the lock of a checkpoint directory until killed: ``hold_lock.py DIR [--fork]``.

Prints ``held <pid>`` once it holds it; with ``--fork``, first forks a child that sleeps (as a
DataLoader worker does) and prints ``child <pid>``. Used by tests/test_checkpoint_dir.py.
"""

import os
import sys
import time

from torchturbo.resume.lock import hold_directory

with hold_directory(sys.argv[1]):
    if "--fork" in sys.argv:
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(f"child {child}", flush=True)
    print(f"held {os.getpid()}", flush=True)
    time.sleep(60)
