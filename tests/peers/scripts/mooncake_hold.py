"""Second Mooncake client: contributes its segment NAME, touches READY_FILE, then idles until SIGTERM.
usage: mooncake_hold.py NAME METADATA_URL MASTER_ADDR READY_FILE"""

import sys
import threading
from pathlib import Path

from mooncake.store import MooncakeDistributedStore

name, meta, master, ready = sys.argv[1:5]
s = MooncakeDistributedStore()
rc = s.setup(name, meta, 64 << 20, 16 << 20, "tcp", "", master)
if rc != 0:
    sys.exit(f"setup returned {rc}")
Path(ready).touch()
threading.Event().wait()
