"""A synthetic neighbour: busy for ``duty`` of every 5 ms, asleep the rest (``python busy_load.py 0.4``
takes about 40 % of one core), standing in for the serving stack's processes on the engine's cores."""
import sys
import time

duty, period = float(sys.argv[1]), 0.005
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep(period * (1 - duty))
