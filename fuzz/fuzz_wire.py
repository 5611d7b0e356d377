"""Coverage-guided fuzzing (atheris) of everything that parses bytes from a peer: frame
prefixes and headers, region descriptors, parameter-server messages.

    python fuzz/fuzz_wire.py -runs=200000        # or without -runs to fuzz until stopped

Any exception other than ProtocolError is a bug (atheris reports it with the input).
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from tensorx import _wire
    from tensorx._ps.wire import protocol
    from tensorx.errors import ProtocolError
    from tensorx.memregion import RegionDescriptor


def one_input(data: bytes) -> None:
    prefix, rest = data[:_wire.PREFIX.size], data[_wire.PREFIX.size:]
    if len(prefix) == _wire.PREFIX.size:
        try:
            kind, header_len, payload_len = _wire.decode_prefix(prefix)
            _wire.decode_header(kind, rest[:header_len], payload_len)
        except ProtocolError:
            pass
    for parse in (RegionDescriptor.from_bytes, protocol.decode):
        try:
            parse(rest)
        except ProtocolError:
            pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
