"""The run that tests/test_interrupt.py interrupts (not collected by the suite: no test_
prefix). Its one test starts a process that ignores SIGINT, as multiprocessing's fork
server and Inductor's compile workers do, writes that process's pid to the file named by
DILGEN_INTERRUPT_READY, and sleeps."""
import os
import subprocess
import sys
import time
from pathlib import Path

IGNORES_SIGINT = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(300)"


def test_sleeps_with_a_child():
    child = subprocess.Popen([sys.executable, "-c", IGNORES_SIGINT])
    ready = Path(os.environ["DILGEN_INTERRUPT_READY"])
    ready.with_suffix(".tmp").write_text(str(child.pid))
    ready.with_suffix(".tmp").replace(ready)
    time.sleep(300)
