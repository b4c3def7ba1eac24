#!/usr/bin/env python3
"""Stand-in for a decode worker on a shared core: busy for BUSY_MS, asleep for IDLE_MS, forever.

Pin it next to a prefill bench to see how prefill copes with a preempting neighbour:
    taskset -c 1 python3 scripts/busy_neighbour.py 12 2 &
    taskset -c 0,1 nice -n 10 target/release/examples/engine_bench --threads 2
"""

import sys
import time


def main() -> None:
    busy = float(sys.argv[1]) / 1000 if len(sys.argv) > 1 else 0.012
    idle = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.002
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(idle)


if __name__ == "__main__":
    main()
