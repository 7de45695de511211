"""Long-running fuzzer for the sans-I/O protocol cores (not part of the test suite).

Feeds mutated valid traffic (and some pure noise) into the SPDY connection, the header-block
decoder, the WebSocket channel decoder, the resize decoder and the port-forward pairer, and
checks the same contract as tests/unit/protocols/test_fuzz.py: only documented errors, and
buffers within their limits. Mutations start from well-formed input because random bytes
rarely get past the first length check; flipped bits in the middle of a valid session reach
the stream state machine and the zlib context.

    .venv/bin/python bench/fuzz_protocols.py                 # 1,000,000 inputs
    .venv/bin/python bench/fuzz_protocols.py -n 50000 --seed 7

On a contract violation it prints the target and the input as hex, and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import resource
import struct
import sys
import time
import traceback
from collections.abc import Callable
from itertools import pairwise

from vkubelet.protocols.channel import ChannelError, ChannelFraming
from vkubelet.protocols.portforward import StreamPairer
from vkubelet.protocols.remotecommand import ResizeDecoder, ResizeError, TerminalSize, encode_resize
from vkubelet.protocols.spdy import (
    ConnectionFailed,
    DataReceived,
    GoAwayReceived,
    PingAcknowledged,
    PingReceived,
    SpdyConnection,
    SpdyLimits,
    StreamOpened,
    StreamReset,
)
from vkubelet.protocols.spdy.frames import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    Setting,
    SettingsFrame,
    SynStreamFrame,
    WindowUpdateFrame,
)
from vkubelet.protocols.spdy.headers import HeaderBlockError, HeaderDecoder, HeaderEncoder

LIMITS = SpdyLimits(
    max_frame_payload=8192, max_header_block=4096, max_concurrent_streams=8, send_chunk=1024
)
EVENTS = (
    StreamOpened,
    DataReceived,
    StreamReset,
    PingReceived,
    PingAcknowledged,
    GoAwayReceived,
    ConnectionFailed,
)
INTERESTING_U32 = (
    0,
    1,
    2,
    3,
    0x7F,
    0xFF,
    0x7FFF,
    0xFFFF,
    0xFFFFFF,
    0x1000000,
    0x7FFFFFFF,
    2**32 - 1,
)
FRAMINGS = (ChannelFraming(), ChannelFraming(base64=True), ChannelFraming(stream_close=True))


class ContractViolation(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise ContractViolation(what)


# --- corpus of valid inputs ----------------------------------------------------------------


def make_session(rng: random.Random) -> tuple[bytes, list[bytes]]:
    """One well-formed client session, plus its compressed header blocks in order."""
    encoder = HeaderEncoder()
    wire = bytearray()
    blocks: list[bytes] = []
    sid = 1
    for _ in range(rng.randint(1, 10)):
        kind = rng.randrange(8)
        if kind <= 2:
            headers = {"streamtype": rng.choice(["error", "stdin", "stdout", "data", "resize"])}
            if rng.random() < 0.5:
                headers |= {"port": str(rng.choice([80, 8080, 0, 70000])), "requestid": str(sid)}
            block = encoder.encode(headers)
            blocks.append(block)
            wire += SynStreamFrame(sid, block, fin=rng.random() < 0.1).serialize()
            sid += 2
        elif kind <= 4:
            target = rng.randrange(1, sid + 2, 2)
            payload = rng.randbytes(rng.choice([0, 1, 10, 100, 2000]))
            wire += DataFrame(target, payload, fin=rng.random() < 0.3).serialize()
        elif kind == 5:
            wire += PingFrame(rng.randrange(1, 2**32)).serialize()
        elif kind == 6:
            target = rng.randrange(1, sid + 2, 2)
            if rng.random() < 0.5:
                wire += RstStreamFrame(target, rng.randint(1, 11)).serialize()
            else:
                block = encoder.encode({"x": "y"})
                blocks.append(block)
                wire += HeadersFrame(target, block, fin=rng.random() < 0.5).serialize()
        else:
            wire += rng.choice(
                [
                    SettingsFrame((Setting(0, 7, 65536),)).serialize(),
                    WindowUpdateFrame(0, 4096).serialize(),
                    GoAwayFrame(sid, 0).serialize(),
                ]
            )
    return bytes(wire), blocks


def make_resize_stream(rng: random.Random) -> bytes:
    sizes = [TerminalSize(rng.randrange(300), rng.randrange(100)) for _ in range(rng.randint(1, 4))]
    return b"".join(encode_resize(s) for s in sizes)


# --- mutation ----------------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        pos = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 3:
            del buf[pos : pos + rng.randint(1, 32)]
        elif op == 4:
            del buf[pos:]
        elif op == 5 and len(buf) >= 4:
            # Overwrite a 32-bit field (lengths, ids, counts) with an edge value.
            at = min(pos, len(buf) - 4)
            buf[at : at + 4] = struct.pack(">I", rng.choice(INTERESTING_U32))
        elif op == 6:
            other = rng.choice(corpus)
            start = rng.randrange(len(other) + 1)
            buf[pos:pos] = other[start : start + rng.randint(1, 64)]
        else:
            start = rng.randrange(len(buf) + 1)
            buf[pos:pos] = buf[start : start + rng.randint(1, 32)]
    return bytes(buf)


def split(rng: random.Random, data: bytes) -> list[bytes]:
    if rng.random() < 0.5 or not data:
        return [data]
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randint(1, 6)))
    return [data[a:b] for a, b in pairwise([0, *cuts, len(data)])]


# --- targets -----------------------------------------------------------------------------------


def run_connection(rng: random.Random, wire: bytes) -> None:
    conn = SpdyConnection(LIMITS)
    failed = False
    sent = 0
    for piece in split(rng, wire):
        for event in conn.receive_data(piece):
            check(isinstance(event, EVENTS), f"unexpected event {event!r}")
            check(not failed, "event after ConnectionFailed")
            if isinstance(event, ConnectionFailed):
                failed = True
            elif isinstance(event, StreamOpened) and rng.random() < 0.3:
                # Answer some streams like an adapter, so the send paths are exercised too.
                conn.reply(event.stream_id)
                if not event.unidirectional:
                    conn.send_data(event.stream_id, b"x" * rng.choice([0, 5, 3000]), fin=True)
        check(conn.buffered_input <= 8 + LIMITS.max_frame_payload, "input buffer over limit")
        check(len(conn.open_streams) <= LIMITS.max_concurrent_streams, "too many streams")
        sent += len(conn.data_to_send())
    check(sent <= 2 * len(wire) + 16 + 4096 * LIMITS.max_concurrent_streams, "output blow-up")


def run_header_decoder(rng: random.Random, blocks: list[bytes]) -> None:
    decoder = HeaderDecoder(max_size=LIMITS.max_header_block)
    try:
        for block in blocks:
            decoder.decode(block)
    except HeaderBlockError:
        pass


def run_channel(rng: random.Random, message: bytes) -> None:
    framing = rng.choice(FRAMINGS)
    wire: bytes | str = message
    if framing.base64 and rng.random() < 0.5:
        wire = message.decode("latin-1")
    with contextlib.suppress(ChannelError):
        framing.decode(wire)


def run_resize(rng: random.Random, wire: bytes) -> None:
    decoder = ResizeDecoder(max_buffer=256)
    try:
        for piece in split(rng, wire):
            for size in decoder.feed(piece):
                check(0 <= size.width <= 0xFFFF and 0 <= size.height <= 0xFFFF, "size range")
    except ResizeError:
        pass


def run_pairer(rng: random.Random, wire: bytes) -> None:
    pairer = StreamPairer()
    text = wire.decode("latin-1")
    for i in range(0, len(text), 12):
        headers = {
            "streamtype": rng.choice(["data", "error", text[i : i + 4]]),
            "port": rng.choice(["80", text[i + 4 : i + 8]]),
            "requestid": text[i + 8 : i + 10],
        }
        pairer.add_stream(rng.randrange(1, 100), headers)
    for request_id in pairer.pending:
        pairer.expire(request_id)


# --- driver ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--inputs", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    rng = random.Random(args.seed)  # noqa: S311 - fuzzing needs reproducible, not secret, bytes
    sessions = [make_session(rng) for _ in range(300)]
    session_wires = [w for w, _ in sessions]
    block_runs = [b for _, b in sessions if b]
    channel_msgs = [
        f.encode(rng.randrange(5), rng.randbytes(rng.randrange(40))) for f in FRAMINGS[:2]
    ] * 50
    channel_corpus = [m.encode() if isinstance(m, str) else m for m in channel_msgs]
    resize_corpus = [make_resize_stream(rng) for _ in range(100)]

    # Each case builds its input first and runs it second, so a failing input can be shown.
    Case = tuple[str, object, Callable[[], None]]

    def connection_case() -> Case:
        if rng.random() < 0.05:
            wire = rng.randbytes(rng.randrange(200))
        else:
            wire = mutate(rng, rng.choice(session_wires), session_wires)
        return "connection", wire, lambda: run_connection(rng, wire)

    def header_case() -> Case:
        blocks = list(rng.choice(block_runs))
        i = rng.randrange(len(blocks))
        blocks[i] = mutate(rng, blocks[i], blocks)
        return "header-decoder", blocks, lambda: run_header_decoder(rng, blocks)

    def channel_case() -> Case:
        message = mutate(rng, rng.choice(channel_corpus), channel_corpus)
        return "channel", message, lambda: run_channel(rng, message)

    def resize_case() -> Case:
        wire = mutate(rng, rng.choice(resize_corpus), resize_corpus)
        return "resize", wire, lambda: run_resize(rng, wire)

    def pairer_case() -> Case:
        wire = rng.randbytes(rng.randrange(120))
        return "pairer", wire, lambda: run_pairer(rng, wire)

    # Weighted towards the connection, which has by far the most state.
    cases: list[Callable[[], Case]] = [connection_case] * 6 + [
        header_case,
        channel_case,
        resize_case,
        pairer_case,
    ]

    start = time.perf_counter()
    report_every = max(args.inputs // 10, 1)
    for i in range(1, args.inputs + 1):
        name, payload, run = rng.choice(cases)()
        try:
            run()
        except Exception:  # a contract violation or an undocumented exception
            traceback.print_exc()
            print(f"FAILED input #{i} target={name} seed={args.seed} input={payload!r}")
            return 1
        if i % report_every == 0:
            elapsed = time.perf_counter() - start
            print(f"{i:>10,} inputs  {i / elapsed:>9,.0f} inputs/s", flush=True)

    elapsed = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(
        f"done: {args.inputs:,} inputs in {elapsed:.1f} s = {args.inputs / elapsed:,.0f} inputs/s, "
        f"peak RSS {peak_mib:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
