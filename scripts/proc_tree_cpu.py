#!/usr/bin/env python3
"""CPU seconds used so far by a process and all its descendants, split into the
`pdserve gateway` processes, the `pdserve worker` processes and the rest, with their
resident memory: one JSON object on stdout. Call it before and after a run and take the
difference over the wall time for the cores used.

    scripts/proc_tree_cpu.py PID
"""
import json
import os
import sys

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def children():
    kids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command may hold spaces: fields after the closing parenthesis.
        fields = stat[stat.rindex(")") + 2:].split()
        kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def usage(pid):
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    rss = int(fields[21]) * PAGE
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    kind = "other"
    if len(argv) > 1 and argv[1] in (b"gateway", b"worker"):
        kind = argv[1].decode()
    return kind, cpu, rss


def main():
    root = int(sys.argv[1])
    kids = children()
    todo, tree = [root], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(kids.get(pid, []))
    out = {k: {"cpu_s": 0.0, "rss_mib": 0.0, "processes": 0} for k in ("gateway", "worker", "other")}
    for pid in tree:
        try:
            kind, cpu, rss = usage(pid)
        except OSError:
            continue
        out[kind]["cpu_s"] += cpu
        out[kind]["rss_mib"] += rss / 2**20
        out[kind]["processes"] += 1
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
