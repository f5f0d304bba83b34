import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

# A test run started in the background by a shell without job control (`cmd &` in a script, or
# under make) inherits SIGINT ignored, and so would every process the tests start: the Ctrl-C
# tests would then see their servers ignore it. A handler (not inherited) makes children start
# with the default disposition, as they would from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import torch  # noqa: E402

torch.set_num_threads(1)
