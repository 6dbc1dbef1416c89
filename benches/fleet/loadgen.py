"""The load generator: sends a workload through one router at its times and records what
each client saw. Standard library only (asyncio streams), so it runs on any python3.

Requests are open-loop: each is sent at its arrival time (divided by the speedup),
however many are outstanding (unless `inflight_max` caps them); an agent's follow-up call is sent its think time after
the call before it finished. A request's lateness is how long after that moment the
generator actually wrote it: when lateness grows, the host cannot keep up and the
figures measure the host, not the router.

Each request is a streamed `/v1/completions` with a fixed output length (`ignore_eos`,
`min_tokens`), or, when its body is given as `(path, body)`, a POST to that path (the
multimodal workload's `/v1/chat/completions`); TTFT is the time to the first streamed
choice.
"""

import asyncio
import json
from urllib.parse import urlsplit

SESSION_HEADER = "x-session-id"
COMPLETIONS_PATH = "/v1/completions"


def request_body(model, prompt_text, output_tokens):
    return json.dumps({
        "model": model, "prompt": prompt_text, "max_tokens": output_tokens, "min_tokens": output_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip


def _usage(rec, chunk):
    """Fills `rec`'s prompt and cached tokens from a chunk holding the usage event."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                usage = json.loads(line[5:]).get("usage") or {}
            except ValueError:
                return
            rec["prompt_tokens"] = usage.get("prompt_tokens")
            rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def _head(host, port, path, body, session):
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close"]  # fmt: skip
    if session:
        lines.append(f"{SESSION_HEADER}: {session}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _read_head(reader):
    """(status, {lower-case name: value}) of a response."""
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionError(f"bad status line {status_line[:80]!r}")
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body_chunks(reader, headers):
    """The response body as it arrives, chunked or not."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise ConnectionError("stream cut inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


async def stream_completion(url, body, session, rec, clock, path=COMPLETIONS_PATH):
    """Posts one streamed completion; fills `rec` with worker, ttft_s, e2e_s or error."""
    u = urlsplit(url)
    writer = None
    sent = clock()
    try:
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(_head(u.hostname, u.port, path, body, session) + body)
        await writer.drain()
        status, headers = await _read_head(reader)
        rec["worker"] = headers.get("x-kvroute-worker")
        if status != 200:
            text = b"".join([c async for c in _body_chunks(reader, headers)])
            rec["error"] = f"HTTP {status}: {text[:200].decode(errors='replace')}"
            return
        pending = b""
        async for chunk in _body_chunks(reader, headers):
            if b'"prompt_tokens"' in chunk:
                _usage(rec, chunk)
            if rec["ttft_s"] is None:
                pending += chunk
                if b'"choices"' in pending:
                    rec["ttft_s"] = clock() - sent
                    pending = b""
                elif b"error" in pending:
                    rec["error"] = f"stream error: {pending[:200].decode(errors='replace')}"
        rec["e2e_s"] = clock() - sent
        if rec["ttft_s"] is None and rec["error"] is None:
            rec["error"] = "stream ended without a token"
    except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()


async def drive(url, requests, bodies, speedup, timeout_s=900.0, inflight_max=None):
    """One record per request (sorted by index): sent_s, lateness_s, worker, ttft_s,
    e2e_s, error, and prompt_tokens and cached_tokens when the worker reported usage;
    times in wall seconds. A body is bytes (a completion) or `(path, bytes)`. With
    `inflight_max`, a request due while that many are outstanding waits for one to
    finish (its lateness counts the wait)."""
    gate = asyncio.Semaphore(inflight_max) if inflight_max else None
    loop = asyncio.get_running_loop()
    clock = loop.time
    t0 = clock()
    finished = {r.index: loop.create_future() for r in requests}
    records = {}

    async def one(r):
        rec = {"i": r.index, "sent_s": None, "lateness_s": None, "worker": None, "ttft_s": None, "e2e_s": None,
               "error": None, "prompt_tokens": None, "cached_tokens": None}  # fmt: skip
        records[r.index] = rec
        try:
            if r.after is None:
                due = t0 + r.arrival_s / speedup
            else:
                due = await finished[r.after] + r.gap_s / speedup
            wait = due - clock()
            if wait > 0:
                await asyncio.sleep(wait)
            if gate is not None:
                await gate.acquire()
            try:
                rec["sent_s"] = clock() - t0
                rec["lateness_s"] = max(0.0, clock() - due)
                body = bodies[r.index]
                path, body = body if isinstance(body, tuple) else (COMPLETIONS_PATH, body)
                await asyncio.wait_for(stream_completion(url, body, r.session, rec, clock, path), timeout_s)
            finally:
                if gate is not None:
                    gate.release()
        except asyncio.TimeoutError:
            rec["error"] = f"no answer in {timeout_s} s"
        finally:
            finished[r.index].set_result(clock())

    await asyncio.gather(*(one(r) for r in requests))
    return [records[i] for i in sorted(records)], clock() - t0


def run(url, requests, bodies, speedup, timeout_s=900.0, inflight_max=None):
    """`drive` on a fresh event loop; returns (records, wall seconds)."""
    return asyncio.run(drive(url, requests, bodies, speedup, timeout_s, inflight_max))

