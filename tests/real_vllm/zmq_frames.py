"""Subscribes to a vLLM KV-event publisher and prints each message's frames, undecoded.

Usage: python zmq_frames.py ENDPOINT

Prints `ready` once subscribed, then one line per multipart message: its frames in
hex, space-separated. Decoding is the Rust side's (kvroute-events), so the test reads
the engine's bytes exactly as kvroute does; only the socket is pyzmq's.
"""

import sys

import zmq

sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
print("ready", flush=True)
while True:
    print(" ".join(f.hex() for f in sock.recv_multipart()), flush=True)
