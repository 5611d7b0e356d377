"""The one schema mechanism (tensorx._schema) and the records built on it: wire frame
headers, region descriptors, parameter-server messages."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorx as tx
from tensorx._ps.wire import protocol
from tensorx._schema import Record, blob, choice, flag, real, seq, table, text, uint
from tensorx.errors import ProtocolError
from tensorx.memregion import DESCRIPTOR_VERSION, MAX_DESCRIPTOR

ITEM = Record("item", {"name": text(8), "n": uint(8)}, strict=True)
SAMPLE = Record("sample", {
    "id": uint(64), "ok": flag(), "x": real(), "name": text(8), "raw": blob(4),
    "mode": choice("sync", "async"), "maybe": uint(16) | None,
    "items": seq(2, table(4, ITEM)), "tags": seq(3, text(4)),
})
GOOD: dict[str, Any] = {"id": 2**64 - 1, "ok": False, "x": 0.5, "name": "abcdefgh",
                        "raw": b"1234", "mode": "sync", "items": [{"name": "a", "n": 255}],
                        "tags": ["abcd"]}


def test_a_record_that_fits_passes_through_with_extra_fields() -> None:
    msg = {**GOOD, "newer": "a field a newer peer added"}
    assert SAMPLE.check(msg) is msg
    assert SAMPLE.check({**GOOD, "maybe": 7})["maybe"] == 7


@pytest.mark.parametrize(("change", "says"), [
    ({"id": 2**64}, "'id' out of range"),
    ({"id": -1}, "'id' out of range"),
    ({"id": True}, "'id' missing or not int"),  # a bool is no int on the wire
    ({"id": None}, "'id' missing or not int"),
    ({"ok": 1}, "'ok' missing or not bool"),
    ({"x": 1}, "'x' missing or not float"),
    ({"name": "abcdefghi"}, "'name' longer than 8"),
    ({"raw": "1234"}, "'raw' missing or not bytes"),
    ({"raw": b"12345"}, "'raw' longer than 4"),
    ({"mode": "bounded\n"}, r"'mode' is bounded\\n, not one of \['async', 'sync'\]"),
    ({"maybe": 1 << 16}, "'maybe' out of range"),
    ({"items": [{}, {}, {}]}, "'items' longer than 2"),
    ({"items": [{"name": "a", "n": 256}]}, "'items' item 0: field 'n' out of range"),
    ({"items": [{"name": "a", "n": 1, "x": 0}]}, "'items' item 0: unexpected field"),
    ({"tags": ["abcde"]}, "'tags' item 0: longer than 4"),
])
def test_each_violation_is_a_protocol_error_naming_record_and_field(
        change: dict[str, Any], says: str) -> None:
    with pytest.raises(ProtocolError, match=f"^sample: field {says}"):
        SAMPLE.check({**GOOD, **change})


def test_a_missing_field_and_a_non_map_are_refused() -> None:
    with pytest.raises(ProtocolError, match="'mode' missing"):
        SAMPLE.check({k: v for k, v in GOOD.items() if k != "mode"})
    for msg in ([], "x", None, 3):
        with pytest.raises(ProtocolError, match="sample: not a map"):
            SAMPLE.check(msg)


def test_what_we_send_may_use_subclasses_of_the_types() -> None:
    class Name(str):
        pass

    class Map(dict):  # type: ignore[type-arg]
        pass

    assert ITEM.check(Map(name=Name("a"), n=1))


def test_a_row_is_a_fixed_length_list_of_the_fields() -> None:
    assert ITEM.check_row(["a", 3]) == ["a", 3]
    for row in (["a"], ["a", 3, 4], ("a", 3), {"name": "a", "n": 3}):
        with pytest.raises(ProtocolError, match="not a list of 2 fields"):
            ITEM.check_row(row)
    with pytest.raises(ProtocolError, match="field 'n' out of range"):
        ITEM.check_row(["a", 300])


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20)


@given(values)
def test_any_decoded_value_is_passed_or_refused_with_a_protocol_error(value: Any) -> None:
    for check in (SAMPLE.check, ITEM.check_row):
        try:
            check(value)
        except ProtocolError:
            pass


# -- the region descriptor: bounded, versioned, on the same mechanism --------------------
def _descriptor(**change: Any) -> bytes:
    fields: dict[str, Any] = {"version": 1, "owner": "a" * 16, "rid": 1,
                              "ck": 2, "n": 64, "device": "cpu", "access": "rw", "keys": {}}
    fields.update(change)
    return bytes(msgpack.packb(list(fields.values()), use_bin_type=True))


@pytest.mark.parametrize(("change", "says"), [
    ({"owner": "a" * 65}, "'owner' longer than 64"),
    ({"device": "tpu"}, "'device' is tpu"),
    ({"access": "x"}, "'access' is x"),
    ({"keys": {str(i): i for i in range(17)}}, "'keys' longer than 16"),
    ({"rid": -1}, "'region_id' out of range"),
])
def test_a_malformed_descriptor_names_its_field(change: dict[str, Any], says: str) -> None:
    with pytest.raises(ProtocolError, match=f"region descriptor: field {says}"):
        tx.RegionDescriptor.from_bytes(_descriptor(**change))


def test_a_descriptor_is_bounded_and_versioned() -> None:
    assert tx.RegionDescriptor.from_bytes(_descriptor()).nbytes == 64
    with pytest.raises(ProtocolError, match="more than"):
        tx.RegionDescriptor.from_bytes(_descriptor(keys={"k": b"x" * MAX_DESCRIPTOR}))
    with pytest.raises(ProtocolError, match=r"version 3; this tensorx reads 1 and 2"):
        tx.RegionDescriptor.from_bytes(_descriptor(version=3))
    with pytest.raises(ProtocolError, match="not a list of 9 fields"):  # 2 adds a field
        tx.RegionDescriptor.from_bytes(_descriptor(version=DESCRIPTOR_VERSION))


def test_a_typed_named_descriptor_is_version_2_and_a_plain_one_stays_version_1() -> None:
    plain = tx.RegionDescriptor("a" * 16, 1, 2, 64, "cpu", "rw")
    assert msgpack.unpackb(plain.to_bytes())[0] == 1  # what every tensorx reads
    typed = dataclasses.replace(plain, name="table", dtype="float32", shape=(4, 4))
    assert msgpack.unpackb(typed.to_bytes())[0] == DESCRIPTOR_VERSION == 2
    assert tx.RegionDescriptor.from_bytes(typed.to_bytes()) == typed
    assert tx.RegionDescriptor.from_bytes(_descriptor()) == plain


@pytest.mark.parametrize(("meta", "says"), [
    ({"name": " x"}, "field 'name': an export's name is 1 to 64 printable"),
    ({"name": "a\nb"}, "field 'name': an export's name"),
    ({"shape": [-1]}, "field 'meta' field 'shape' item 0: out of range"),
    ({"dtype": 3}, "field 'meta' field 'dtype' missing or not str"),
])
def test_a_malformed_descriptor_meta_is_refused(meta: dict[str, Any], says: str) -> None:
    raw = _descriptor(version=2, meta=meta)
    with pytest.raises(ProtocolError, match=re.escape(says)):
        tx.RegionDescriptor.from_bytes(raw)


# -- parameter-server messages: the interface stays encode(kind, **fields) / decode ------
def test_a_ps_message_roundtrips_and_a_bad_field_is_named() -> None:
    msg = protocol.decode(protocol.encode("part", k=3))
    assert msg == {"t": "part", "k": 3}
    with pytest.raises(ProtocolError, match=r"^part message: field 'k' missing or not int"):
        protocol.encode("part", k=True)
    with pytest.raises(ProtocolError, match=r"^gnorm message: field 'ranks' item 1: missing"):
        protocol.encode("gnorm", shard=0, version=1, ranks=[0, "1"], sumsq=1.0)
    raw = msgpack.packb({"t": "part", "k": 2**63}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="'k' out of range"):
        protocol.decode(raw)


def test_an_unknown_ps_message_type_is_named_escaped() -> None:
    with pytest.raises(ProtocolError, match=r"unknown control message type hi\\nthere"):
        protocol.decode(msgpack.packb({"t": "hi\nthere"}))


def test_the_welcome_offers_are_checked_by_their_records() -> None:
    assert protocol.share_offer({"share": {}}) is None
    offer = {"params": b"p", "slot": b"s"}
    assert protocol.share_offer({"share": offer}) == offer
    with pytest.raises(ProtocolError, match="share offer: unexpected field"):
        protocol.share_offer({"share": {**offer, "x": b""}})
    optim = {"defaults": {"lr": 0.1}, "flat": False,
             "groups": [{"hp": {"lr": 0.1}, "params": ["w", "b"]}]}
    assert protocol.optim_info({"optim": optim}) == optim
    bad = {**optim, "groups": [{"hp": {}, "params": ["w", 3]}]}
    with pytest.raises(ProtocolError, match="optimizer: field 'groups' item 0: field 'params'"):
        protocol.optim_info({"optim": bad})


packable = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20)
names = sorted({name for record in protocol.SCHEMAS.values() for name in record.fields})
messages = st.builds(lambda kind, fields: {**fields, "t": kind},
                     st.sampled_from(sorted(protocol.SCHEMAS)),
                     st.dictionaries(st.sampled_from(names), packable, max_size=8))


@given(messages | packable)
def test_any_ps_payload_is_a_message_or_a_protocol_error(value: Any) -> None:
    try:
        protocol.decode(msgpack.packb(value, use_bin_type=True))
    except ProtocolError:
        pass
