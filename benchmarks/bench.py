"""Run `foldc bench` from a source tree (the device machine has no install):

    PYTHONPATH=. python3 benchmarks/bench.py --out $OUT/bench [--quick] [--no-tune]
"""
import sys

from foldc.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
