"""Index keys in N1QL collation order, encoded as bytes that sort the same way under memcmp.

An index key is the list of a document's values at the index's field paths. LevelDB orders keys by
plain byte comparison, so each value is encoded so that byte order equals N1QL collation:
MISSING < null < false < true < numbers < strings < arrays < objects. Every encoding is
self-delimiting and prefix-free: a composite key is the concatenation of its components, and a
docid appended to it makes the entries sort by (key, docid).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, ClassVar, Final, TypeAlias, final

__all__ = [
    "MISSING",
    "JSONValue",
    "KeyEncodingError",
    "Missing",
    "collate",
    "decode_key",
    "decode_value",
    "encode_desc",
    "encode_key",
    "encode_value",
    "entry_tail",
    "field_value",
    "index_key",
    "join_entries",
    "split_entries",
    "split_entry",
]

JSONValue: TypeAlias = Any
"""A JSON value (None, bool, int, float, str, list, dict); as a key component, also MISSING."""


class KeyEncodingError(ValueError):
    """A value cannot be encoded as an index key, or bytes are not a valid key encoding."""


@final
class Missing:
    """The type of MISSING: an absent field, which N1QL sorts before null."""

    __slots__ = ()
    _instance: ClassVar[Missing | None] = None

    def __new__(cls) -> Missing:
        """Return the one instance, so `value is MISSING` is always the right test."""
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        """Pickle by reference to the module global, keeping the singleton across processes."""
        return "MISSING"

    def __copy__(self) -> Missing:
        return self

    def __deepcopy__(self, memo: object) -> Missing:
        return self


MISSING: Final = Missing()

# Type bytes; 0x00 is the terminator of strings, arrays and objects and sorts before all of them.
_T_MISSING: Final = 0x01
_T_NULL: Final = 0x02
_T_FALSE: Final = 0x03
_T_TRUE: Final = 0x04
_T_NUMBER: Final = 0x05
_T_STRING: Final = 0x06
_T_ARRAY: Final = 0x07
_T_OBJECT: Final = 0x08
_END: Final = 0x00

# Number suffix bytes: how an int differs from the double it rounds to.
_SFX_EXACT: Final = 0x80
_SFX_ABOVE: Final = 0x81
_SFX_BELOW: Final = 0x7F

_DOUBLE: Final = struct.Struct(">d")
_UINT64: Final = struct.Struct(">Q")
_SIGN_BIT: Final = 1 << 63
_ALL_BITS: Final = (1 << 64) - 1
_EXACT_LIMIT: Final = 1 << 53  # every int with abs <= 2**53 is exactly a double
_INT_LIMIT: Final = 1 << 1023  # larger ints are accepted only if they are exactly a double
_MAX_FIELDS: Final = 0xFFFF_FFFF
MAX_NESTING: Final = 256  # arrays and objects within a key value (documents: 128 at most)
_INVERT: Final = bytes(range(255, -1, -1))
_STRING_END: Final = b"\x00\x00"
_ESCAPED_ZERO: Final = b"\x00\xff"
_ENCODED_MISSING: Final = bytes([_T_MISSING])


# ---------------------------------------------------------------------------------------------
# Encoding


def _ordered_double(d: float) -> bytes:
    """The 8 bytes of a finite double, transformed so that memcmp orders them by value."""
    bits: int = _UINT64.unpack(_DOUBLE.pack(d))[0]
    bits ^= _ALL_BITS if bits & _SIGN_BIT else _SIGN_BIT
    return _UINT64.pack(bits)


def _encode_int(x: int, out: bytearray) -> None:
    """Append a number that is an int: its nearest double, then how far the int is from it."""
    if -_EXACT_LIMIT <= x <= _EXACT_LIMIT:
        out.append(_T_NUMBER)
        out += _ordered_double(float(x))
        out.append(_SFX_EXACT)
        return
    try:
        d = float(x)
    except OverflowError:
        raise KeyEncodingError(f"integer out of range for an index key: {x}") from None
    delta = x - int(d)
    if delta and (x >= _INT_LIMIT or x <= -_INT_LIMIT):
        raise KeyEncodingError(f"integer out of range for an index key: {x}")
    out.append(_T_NUMBER)
    out += _ordered_double(d)
    if delta == 0:
        out.append(_SFX_EXACT)
    elif delta > 0:
        magnitude = delta.to_bytes((delta.bit_length() + 7) // 8, "big")
        out.append(_SFX_ABOVE)
        out.append(len(magnitude))
        out += magnitude
    else:
        delta = -delta
        magnitude = delta.to_bytes((delta.bit_length() + 7) // 8, "big")
        out.append(_SFX_BELOW)
        out.append(255 - len(magnitude))
        out += magnitude.translate(_INVERT)


def _encode_float(f: float, out: bytearray) -> None:
    """Append a float; an integral float encodes exactly like the equal int."""
    if not math.isfinite(f):
        raise KeyEncodingError(f"NaN and infinities cannot be index keys: {f!r}")
    out.append(_T_NUMBER)
    out += _ordered_double(f + 0.0)  # + 0.0 turns -0.0 into 0.0, the int 0
    out.append(_SFX_EXACT)


def _encode_str(s: str, out: bytearray) -> None:
    """Append a string: UTF-8 with 0x00 escaped as 0x00 0xFF, terminated by 0x00 0x00."""
    raw = s.encode("utf-8", "surrogatepass")
    out.append(_T_STRING)
    if b"\x00" in raw:
        raw = raw.replace(b"\x00", _ESCAPED_ZERO)
    out += raw
    out += _STRING_END


def _encode_dict(obj: dict[Any, Any], out: bytearray, depth: int) -> None:
    """Append an object: field count, then key/value pairs in key order, then the terminator."""
    count = len(obj)
    if count > _MAX_FIELDS:
        raise KeyEncodingError(f"object has too many fields for an index key: {count}")
    for k in obj:
        if not isinstance(k, str):
            raise KeyEncodingError(f"object keys must be strings, not {type(k).__name__}")
    out.append(_T_OBJECT)
    out += count.to_bytes(4, "big")
    # str order is code point order, which is the order of the UTF-8 bytes.
    for k in sorted(obj):
        _encode_str(k, out)
        _encode(obj[k], out, depth + 1)
    out.append(_END)


def _encode(value: Any, out: bytearray, depth: int = 0) -> None:
    """Append the encoding of a JSON value (never MISSING) to out, `depth` arrays and objects
    deep (a limit of its own: compiled, deep recursion would overflow the C stack)."""
    if depth > MAX_NESTING:
        raise KeyEncodingError("value is nested too deeply")
    t = type(value)
    if t is str:
        _encode_str(value, out)
    elif t is int:
        _encode_int(value, out)
    elif t is float:
        _encode_float(value, out)
    elif value is None:
        out.append(_T_NULL)
    elif t is bool:
        out.append(_T_TRUE if value else _T_FALSE)
    elif t is list or t is tuple:
        out.append(_T_ARRAY)
        for item in value:
            _encode(item, out, depth + 1)
        out.append(_END)
    elif t is dict:
        _encode_dict(value, out, depth)
    else:
        _encode_other(value, out, depth)


def _encode_other(value: Any, out: bytearray, depth: int) -> None:
    """Encode subclasses of the JSON types (bool before int: bool is not a number)."""
    if value is MISSING:
        raise KeyEncodingError("MISSING can only be a component of a composite key")
    if isinstance(value, bool):
        out.append(_T_TRUE if value else _T_FALSE)
    elif isinstance(value, int):
        _encode_int(int(value), out)
    elif isinstance(value, float):
        _encode_float(float(value), out)
    elif isinstance(value, str):
        _encode_str(str(value), out)
    elif isinstance(value, list | tuple):
        _encode(list(value), out, depth)
    elif isinstance(value, dict):
        _encode_dict(value, out, depth)
    else:
        raise KeyEncodingError(f"not a JSON value: {type(value).__name__}")


def encode_value(value: JSONValue) -> bytes:
    """Encode one value (or MISSING) as bytes whose memcmp order is N1QL collation order."""
    if value is MISSING:
        return _ENCODED_MISSING
    out = bytearray()
    try:
        _encode(value, out)
    except RecursionError:
        raise KeyEncodingError("value is nested too deeply") from None
    return bytes(out)


def encode_desc(value: JSONValue) -> bytes:
    """Encode a value of a DESC key position: every byte inverted, so memcmp order is reversed.

    Inverting keeps the encoding self-delimiting and prefix-free; its type byte becomes 0xF7 to
    0xFE, never 0xFF, so `P + 0xFF` still follows every key that starts with the prefix P.
    """
    return encode_value(value).translate(_INVERT)


def encode_key(values: Sequence[JSONValue], desc: Sequence[bool] = ()) -> bytes:
    """Encode a composite key: the concatenation of its components' encodings (`desc[i]`: the
    i-th is stored descending, `encode_desc`)."""
    if any(desc):
        return b"".join(
            encode_desc(v) if i < len(desc) and desc[i] else encode_value(v)
            for i, v in enumerate(values)
        )
    out = bytearray()
    try:
        for value in values:
            if value is MISSING:
                out.append(_T_MISSING)
            else:
                _encode(value, out)
    except RecursionError:
        raise KeyEncodingError("value is nested too deeply") from None
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Decoding


def _truncated() -> KeyEncodingError:
    return KeyEncodingError("truncated key encoding")


def _decode_str(data: bytes, pos: int) -> tuple[str, int]:
    """Decode the body of a string starting at pos (after its type byte)."""
    end = data.find(_STRING_END, pos)
    if end >= 0 and data.find(b"\x00", pos, end) < 0:  # no escaped zeros: the common case
        raw = data[pos:end]
        pos = end + 2
    else:
        parts = []
        while True:
            end = data.find(b"\x00", pos)
            if end < 0 or end + 1 >= len(data):
                raise _truncated()
            parts.append(data[pos:end])
            marker = data[end + 1]
            pos = end + 2
            if marker == 0x00:
                break
            if marker != 0xFF:
                raise KeyEncodingError(f"bad string escape at offset {end}")
            parts.append(b"\x00")
        raw = b"".join(parts)
    try:
        return raw.decode("utf-8", "surrogatepass"), pos
    except UnicodeDecodeError as exc:
        raise KeyEncodingError(f"string is not valid UTF-8: {exc}") from None


def _decode_number(data: bytes, pos: int) -> tuple[int | float, int]:
    """Decode the body of a number starting at pos; rejects any non-canonical encoding."""
    if pos + 9 > len(data):
        raise _truncated()
    bits: int = _UINT64.unpack_from(data, pos)[0]
    bits ^= _SIGN_BIT if bits & _SIGN_BIT else _ALL_BITS
    if bits == _SIGN_BIT:
        raise KeyEncodingError("negative zero is not a canonical number encoding")
    d: float = _DOUBLE.unpack(_UINT64.pack(bits))[0]
    if not math.isfinite(d):
        raise KeyEncodingError("NaN or infinity in a number encoding")
    suffix = data[pos + 8]
    pos += 9
    if suffix == _SFX_EXACT:
        return (int(d) if d.is_integer() else d), pos
    if suffix != _SFX_ABOVE and suffix != _SFX_BELOW:
        raise KeyEncodingError(f"bad number suffix 0x{suffix:02x}")
    if not d.is_integer():
        raise KeyEncodingError("an integer offset from a non-integral double")
    if pos >= len(data):
        raise _truncated()
    above = suffix == _SFX_ABOVE
    length = data[pos] if above else 255 - data[pos]
    pos += 1
    if length == 0:
        raise KeyEncodingError("empty integer offset")
    if pos + length > len(data):
        raise _truncated()
    magnitude = data[pos : pos + length]
    if not above:
        magnitude = magnitude.translate(_INVERT)
    if magnitude[0] == 0:
        raise KeyEncodingError("integer offset has a leading zero byte")
    delta = int.from_bytes(magnitude, "big")
    x = int(d) + delta if above else int(d) - delta
    if x >= _INT_LIMIT or x <= -_INT_LIMIT or float(x) != d:
        raise KeyEncodingError("integer offset does not round to its double")
    return x, pos + length


def _decode(data: bytes, pos: int, depth: int = 0) -> tuple[Any, int]:
    """Decode the value whose type byte is at pos, `depth` arrays and objects deep; MISSING is
    returned as MISSING."""
    if depth > MAX_NESTING:
        raise KeyEncodingError("encoding is nested too deeply")
    if pos >= len(data):
        raise _truncated()
    t = data[pos]
    pos += 1
    if t == _T_STRING:
        return _decode_str(data, pos)
    if t == _T_NUMBER:
        return _decode_number(data, pos)
    if t == _T_NULL:
        return None, pos
    if t == _T_FALSE:
        return False, pos
    if t == _T_TRUE:
        return True, pos
    if t == _T_MISSING:
        return MISSING, pos
    if t == _T_ARRAY:
        items: list[Any] = []
        while True:
            if pos >= len(data):
                raise _truncated()
            if data[pos] == _END:
                return items, pos + 1
            if data[pos] == _T_MISSING:
                raise KeyEncodingError("MISSING inside an array")
            item, pos = _decode(data, pos, depth + 1)
            items.append(item)
    if t == _T_OBJECT:
        if pos + 4 > len(data):
            raise _truncated()
        count = int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
        obj: dict[str, Any] = {}
        previous: str | None = None
        for _ in range(count):
            if pos >= len(data):
                raise _truncated()
            if data[pos] != _T_STRING:
                raise KeyEncodingError("object key is not a string")
            key, pos = _decode_str(data, pos + 1)
            if previous is not None and key <= previous:
                raise KeyEncodingError("object keys are not in sorted order")
            previous = key
            if pos < len(data) and data[pos] == _T_MISSING:
                raise KeyEncodingError("MISSING inside an object")
            obj[key], pos = _decode(data, pos, depth + 1)
        if pos >= len(data):
            raise _truncated()
        if data[pos] != _END:
            raise KeyEncodingError("object has more fields than its count")
        return obj, pos + 1
    raise KeyEncodingError(f"unknown type byte 0x{t:02x} at offset {pos - 1}")


def decode_value(data: bytes, pos: int = 0) -> tuple[JSONValue, int]:
    """Decode one value starting at pos; return it and the offset just after it."""
    if pos < 0:
        raise KeyEncodingError(f"negative offset {pos}")
    try:
        return _decode(data, pos)
    except RecursionError:
        raise KeyEncodingError("encoding is nested too deeply") from None


def decode_key(
    data: bytes, count: int, pos: int = 0, desc: Sequence[bool] = ()
) -> tuple[list[JSONValue], int]:
    """Decode `count` composite-key components starting at pos; return them and the end offset.

    `desc[i]` says the i-th component is stored descending (`encode_desc`).
    """
    if pos < 0:
        raise KeyEncodingError(f"negative offset {pos}")
    values: list[JSONValue] = []
    try:
        if not any(desc):
            for _ in range(count):
                value, pos = _decode(data, pos)
                values.append(value)
            return values, pos
        for i in range(count):
            if i < len(desc) and desc[i]:
                value, end = _decode(bytes(data[pos:]).translate(_INVERT), 0)
                pos += end
            else:
                value, pos = _decode(data, pos)
            values.append(value)
    except RecursionError:
        raise KeyEncodingError("encoding is nested too deeply") from None
    return values, pos


_ENTRY_LENGTH: Final = struct.Struct(">I")


def join_entries(keys: Sequence[bytes]) -> bytes:
    """The keys of one document in an array index, as its back-index value: each key after
    its length (u32, big-endian). Empty keys are never joined: b"" means "in no entry"."""
    pack = _ENTRY_LENGTH.pack
    return b"".join(pack(len(k)) + k for k in keys)


def split_entries(joined: bytes) -> list[bytes]:
    """The keys `join_entries` joined, in their order."""
    out = []
    pos, end = 0, len(joined)
    unpack = _ENTRY_LENGTH.unpack_from
    while pos < end:
        if pos + 4 > end:
            raise _truncated()
        (length,) = unpack(joined, pos)
        pos += 4
        if pos + length > end:
            raise _truncated()
        out.append(bytes(joined[pos : pos + length]))
        pos += length
    return out


_DOCID_LENGTH: Final = struct.Struct(">H")
MAX_DOCID_BYTES: Final = 0xFFFF


def entry_tail(docid: bytes) -> bytes:
    """What follows the key in a main-index entry: the docid, then its length (u16, big-endian).

    The length lets a scan find where the key ends from the entry's last two bytes, without
    decoding the key (as Couchbase's secondary index entries do). Big-endian, its first byte is
    0 for docids under 256 bytes, below every byte of a docid without NUL: entries of one key
    still sort by docid.
    """
    return docid + _DOCID_LENGTH.pack(len(docid))


def split_tail(entry: bytes) -> tuple[bytes, bytes]:
    """A main-index entry's encoded key and its docid, found by the tail alone (no decoding)."""
    (length,) = _DOCID_LENGTH.unpack_from(entry, len(entry) - 2)
    cut = len(entry) - 2 - length
    if cut < 0:
        raise _truncated()
    return entry[:cut], entry[cut:-2]


def split_entry(
    data: bytes, count: int, desc: Sequence[bool] = ()
) -> tuple[list[JSONValue], bytes]:
    """Split a main-index entry (`count` key values, then `entry_tail`) into values and docid."""
    values, pos = decode_key(data, count, 0, desc)
    if len(data) < pos + 2:
        raise _truncated()
    (length,) = _DOCID_LENGTH.unpack_from(data, len(data) - 2)
    if pos + length + 2 != len(data):
        raise KeyEncodingError(
            f"entry holds {len(data) - pos - 2} docid bytes after its key, its tail says {length}"
        )
    return values, bytes(data[pos : pos + length])


# ---------------------------------------------------------------------------------------------
# Documents


def field_value(doc: JSONValue, path: str) -> JSONValue:
    """The value at a dotted path (`address.zip`); MISSING if a step is absent or not an object."""
    if "." not in path:
        return doc.get(path, MISSING) if isinstance(doc, dict) else MISSING
    value = doc
    for step in path.split("."):
        if not isinstance(value, dict):
            return MISSING
        value = value.get(step, MISSING)
    return value


def index_key(doc: JSONValue, paths: Sequence[str]) -> bytes:
    """The encoded composite key of doc for an index on paths; b'' if the leading field is missing.

    N1QL does not index a document whose leading key is missing; trailing missing fields are kept.
    """
    if not paths:
        raise ValueError("an index needs at least one field")
    first = field_value(doc, paths[0])
    if first is MISSING:
        return b""
    return encode_key([first, *(field_value(doc, path) for path in paths[1:])])


# ---------------------------------------------------------------------------------------------
# Reference comparator


def _rank(value: JSONValue) -> int:
    """The collation rank of a value's type (bool is tested before int: it is not a number)."""
    if value is MISSING:
        return 0
    if value is None:
        return 1
    if isinstance(value, bool):
        return 3 if value else 2
    if isinstance(value, int | float):
        return 4
    if isinstance(value, str):
        return 5
    if isinstance(value, list | tuple):
        return 6
    if isinstance(value, dict):
        return 7
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _cmp(a: Any, b: Any) -> int:
    return int(a > b) - int(a < b)


def collate(a: JSONValue, b: JSONValue) -> int:
    """Compare two decoded values in N1QL collation order (-1, 0, 1), without the byte encoding.

    A reference for tests and dumps: types by rank, numbers by exact value (Python compares int
    and float exactly), strings by code point, arrays element-wise, objects by size then pairs.
    """
    ra, rb = _rank(a), _rank(b)
    if ra != rb:
        return -1 if ra < rb else 1
    if ra == 4 or ra == 5:
        return _cmp(a, b)
    if ra == 6:
        for x, y in zip(a, b, strict=False):
            c = collate(x, y)
            if c:
                return c
        return _cmp(len(a), len(b))
    if ra == 7:
        c = _cmp(len(a), len(b))
        if c:
            return c
        for ka, kb in zip(sorted(a), sorted(b), strict=True):
            c = _cmp(ka, kb) or collate(a[ka], b[kb])
            if c:
                return c
    return 0
