"""Print what a vLLM instance publishes as KV-cache events, one JSON line per event.

    scripts/vllm-cpu.sh python scripts/vllm_kv_events_sub.py ENDPOINT [SECONDS] [--bind]

ENDPOINT is the publisher's `endpoint` from --kv-events-config. vLLM binds ipc:// and
wildcard tcp endpoints and connects to any other tcp endpoint; so for `ipc://...` this
subscriber connects, and for `tcp://127.0.0.1:PORT` (the central-collector layout, where
every vLLM connects to one collector) pass --bind and it binds that address itself.
Each line: the ZeroMQ topic, the sequence number, the batch's timestamp and
data_parallel_rank, and the event decoded from msgpack (block hashes as hex when bytes).
Exits after SECONDS (default 30). pyzmq and msgspec come with vllm.
"""

import json
import sys
import time

import msgspec
import zmq


def plain(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    bind = "--bind" in sys.argv
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    endpoint = args[0]
    seconds = float(args[1]) if len(args) > 1 else 30.0
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    (sock.bind if bind else sock.connect)(endpoint)
    decoder = msgspec.msgpack.Decoder()
    deadline = time.monotonic() + seconds
    print(json.dumps({"listening": endpoint, "bind": bind}), flush=True)
    while time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        frames = sock.recv_multipart()
        if len(frames) != 3:
            print(json.dumps({"odd_frames": [plain(f) for f in frames]}), flush=True)
            continue
        topic, seq, payload = frames
        batch = decoder.decode(payload)
        # EventBatch is array-like: [ts, events, data_parallel_rank?]
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
        for event in events:
            print(
                json.dumps(
                    {
                        "topic": topic.decode(errors="replace"),
                        "seq": int.from_bytes(seq, "big"),
                        "ts": ts,
                        "dp_rank": rank,
                        "event": plain(event),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
