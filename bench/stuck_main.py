"""Run a script (train.py) whose main thread blocks for good on SIGUSR1 while its other threads (the heartbeat)
keep running: the stuck process that blocked I/O or a deadlock leaves. For fault tests (tests/test_multihost.py,
bench/chaos.py):

    python bench/stuck_main.py train.py --config ...      # then: kill -USR1 <pid>
"""
import runpy
import signal
import sys
import time

signal.signal(signal.SIGUSR1, lambda signum, frame: time.sleep(10 ** 6))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
