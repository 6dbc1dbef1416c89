"""A test KV-event publisher: XPUB for the stream, ROUTER for replay, driven by
JSON lines on stdin. Binds free ports on 127.0.0.1 and prints them first.

Framing: live [topic, seq (8 bytes BE), payload]; replay replies
[identity, empty, topic, seq, payload] ("topic" form) or [identity, empty, seq,
payload] ("vllm" form), then the end marker with seq -1 and an empty payload.

Commands (one JSON object per line; each is answered by one JSON line):
  {"op": "wait_sub"}                     wait until a subscriber has subscribed
  {"op": "batch", "events": [...], "form": "map"|"array", "rank": int|null,
   "send": bool}                         encode, buffer, and (unless send is false) publish
  {"op": "raw", "hex": "...", "send": bool}   same with a raw payload
  {"op": "resend", "seq": n}             publish buffered seq n again (a duplicate)
  {"op": "restart"}                      sequence numbers start again at 0, buffer emptied
  {"op": "quit"}
"""

import argparse
import collections
import json
import queue
import sys
import threading
import time

import zmq

from wire import EventBatch, encode, event_from_json

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def bind(socket, port):
    """Binds to `port` on loopback, or to a free one when it is 0; the port."""
    if port == 0:
        return socket.bind_to_random_port("tcp://127.0.0.1")
    socket.bind(f"tcp://127.0.0.1:{port}")
    return port


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay-form", choices=["topic", "vllm"], default="topic")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--topic", default="")
    ap.add_argument("--pub-port", type=int, default=0, help="0: a free port")
    ap.add_argument("--replay-port", type=int, default=0, help="0: a free port")
    args = ap.parse_args()

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_port = bind(pub, args.pub_port)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = bind(router, args.replay_port)
    topic = args.topic.encode()

    buffer = collections.deque(maxlen=args.buffer_steps)
    seq = 0
    subscribed = False

    commands = queue.Queue()

    def read_stdin():
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put({"op": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def service_replay():
        frames = router.recv_multipart()
        if len(frames) != 3:
            return
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for s, payload in list(buffer):
            if s >= start_seq:
                body = [topic] if args.replay_form == "topic" else []
                router.send_multipart([ident, b""] + body + [s.to_bytes(8, "big"), payload])
        body = [b""] if args.replay_form == "topic" else []
        router.send_multipart([ident, b""] + body + [END_SEQ, b""])

    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    poller.register(router, zmq.POLLIN)
    reply({"pub": pub_port, "replay": replay_port})

    pending_wait = False
    while True:
        for sock, _ in poller.poll(5):
            if sock is pub:
                msg = pub.recv()
                if msg[:1] == b"\x01":
                    subscribed = True
            elif sock is router:
                service_replay()
        if pending_wait and subscribed:
            pending_wait = False
            reply({"ok": "wait_sub"})
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            continue
        op = cmd["op"]
        if op == "quit":
            break
        if op == "wait_sub":
            pending_wait = True
            continue
        if op in ("batch", "raw"):
            if op == "batch":
                array_like = cmd.get("form", "map") == "array"
                events = [event_from_json(e, array_like) for e in cmd["events"]]
                payload = encode(EventBatch(ts=time.time(), events=events, data_parallel_rank=cmd.get("rank")))
            else:
                payload = bytes.fromhex(cmd["hex"])
            this = seq
            seq += 1
            buffer.append((this, payload))
            if cmd.get("send", True):
                pub.send_multipart([topic, this.to_bytes(8, "big"), payload])
            reply({"ok": op, "seq": this})
        elif op == "resend":
            for s, payload in buffer:
                if s == cmd["seq"]:
                    pub.send_multipart([topic, s.to_bytes(8, "big"), payload])
            reply({"ok": "resend"})
        elif op == "restart":
            seq = 0
            buffer.clear()
            reply({"ok": "restart"})
    pub.close(0)
    router.close(0)


if __name__ == "__main__":
    main()
