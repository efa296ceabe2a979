"""`torchturbo train` whose checkpoint saves outside ``--save-every`` (the one a stop signal
starts) stall once all files are written and before the rename: a test SIGKILLs it there.

    python stalled_save.py SAVE_EVERY train ARGS...
"""

import sys
import time

import torchturbo.resume.files as checkpoint
from torchturbo.cli import main

save_every = int(sys.argv[1])
rename = checkpoint._rename_into_place


def stalled_rename(tmp, final):
    step = int(final.name.rpartition("-")[2])
    if step % save_every:
        print(f"stalled saving step {step}", flush=True)
        time.sleep(600)
    rename(tmp, final)


checkpoint._rename_into_place = stalled_rename
raise SystemExit(main(sys.argv[2:]))
