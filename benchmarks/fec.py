"""CPU cost of FEC transfers: the RaptorQ adapter's throughput, then a whole transfer.

Part 1 times the adapter (transport/fec.py) per block size k, with 1328-byte symbols
(a 1350-byte datagram): the encoder's precode plus 10% repair symbols, a decode with 5%
of the source symbols replaced by repair symbols, and a decode from source symbols only.
Part 2 pushes one payload through SenderTransfer -> Bernoulli loss -> ReceiverTransfer
in process (no clock: the receiver's timer is fired as soon as the sender's queue is
empty) and reports symbols sent per source symbol, repair rounds, and the CPU seconds
spent in the sender (slicing, precode, repair symbols, headers) and in the receiver
(parsing, placing, decoding). All times are ``time.process_time``. Prints JSON lines::

    python benchmarks/fec.py --size-mb 16 --loss 0.01 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import time

from wanswarm.transport.config import FecConfig
from wanswarm.transport.fec import BlockDecoder, BlockEncoder, TransferLayout
from wanswarm.transport.session import ReceiverTransfer, SenderTransfer
from wanswarm.transport.session_wire import symbol_size_for

SYMBOL = symbol_size_for(1350)


def adapter_throughput(k: int, rng: random.Random) -> dict[str, float]:
    data = rng.randbytes(k * SYMBOL)
    rounds = max(1, 8192 // k)
    start = time.process_time()
    for _ in range(rounds):
        encoder = BlockEncoder(data, SYMBOL)
        repairs = encoder.repair_symbols(k, k // 10)
    encode = (time.process_time() - start) / rounds
    lost = set(rng.sample(range(k), k // 20))
    symbols = [
        (esi, data[esi * SYMBOL : (esi + 1) * SYMBOL]) for esi in range(k) if esi not in lost
    ]
    symbols += [(k + i, bytes(r)) for i, r in enumerate(repairs[: len(lost)])]
    start = time.process_time()
    for _ in range(rounds):
        decoder = BlockDecoder(len(data), SYMBOL)
        result = None
        for esi, symbol in symbols:
            result = decoder.add(esi, symbol)
    decode = (time.process_time() - start) / rounds
    assert result == data
    start = time.process_time()
    for _ in range(rounds):
        decoder = BlockDecoder(len(data), SYMBOL)
        for esi in range(k):
            result = decoder.add(esi, data[esi * SYMBOL : (esi + 1) * SYMBOL])
    sources_only = (time.process_time() - start) / rounds
    megabytes = len(data) / 1e6
    return {
        "k": k,
        "encode_MBps": round(megabytes / encode, 1),
        "decode_5pct_MBps": round(megabytes / decode, 1),
        "decode_sources_MBps": round(megabytes / sources_only, 1),
    }


def transfer(size: int, loss: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    config = FecConfig()
    payload = rng.randbytes(size)
    sender_cpu = receiver_cpu = 0.0
    start = time.process_time()
    sender = SenderTransfer(1, payload, SYMBOL, config, loss_rate=loss)
    layout = sender.layout
    receiver = ReceiverTransfer(
        1,
        TransferLayout.from_peer(layout.length, SYMBOL, layout.block_symbols, max_length=1 << 30),
        config,
        now=0.0,
        rtt=0.1,
    )
    sender_cpu += time.process_time() - start
    rounds = 0
    while not receiver.done:
        start = time.process_time()
        datagrams = sender.datagrams_to_send(1 << 30, 0.0)
        sender_cpu += time.process_time() - start
        arriving = [d for d in datagrams if rng.random() >= loss]
        start = time.process_time()
        for data in arriving:
            if receiver.receive_datagram(data, 0.0):
                break
        request = None if receiver.done else receiver.handle_timer(1e9)
        receiver_cpu += time.process_time() - start
        if request is not None:
            rounds += 1
            sender.receive_control(request, 1.0, 0.1)
    sender.receive_control(receiver.completion(), 1.0, 0.1)
    assert receiver.result() == payload
    return {
        "size_MB": size / 1e6,
        "loss": loss,
        "blocks": layout.num_blocks,
        "source_symbols": layout.num_symbols,
        "sent": sender.sent,
        "sent_per_source": round(sender.sent / layout.num_symbols, 4),
        "repair_rounds": rounds,
        "sender_cpu_s": round(sender_cpu, 3),
        "receiver_cpu_s": round(receiver_cpu, 3),
        "us_per_datagram": round(1e6 * (sender_cpu + receiver_cpu) / sender.sent, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip-adapter", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if not args.skip_adapter:
        for k in (256, 1024, 4096):
            print(json.dumps(adapter_throughput(k, rng)))
    print(json.dumps(transfer(int(args.size_mb * (1 << 20)), args.loss, args.seed)))


if __name__ == "__main__":
    main()
