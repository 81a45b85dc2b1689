"""A decimal ``w * 10**q`` as the nearest float64, compiled (``features.jsonscan`` reads a JSON
number's digits and calls this; there is no float parser in numba).

Two paths, each either exact or refusing (``ok`` False, and the caller falls back to a parser
that handles every case -- orjson):

- Clinger's fast path: ``w <= 2**53`` and ``|q| <= 22``: w and 10**|q| are exact doubles, so one
  multiplication or division rounds once, correctly. Counts and short decimals take it.
- Eisel and Lemire's (``Number Parsing at a Gigabyte per Second``, 2021; Go's
  ``strconv.eiselLemire64``): w normalised to 64 bits times a 128-bit truncation of 5**q scaled
  to [2**127, 2**128), giving the top bits of the exact product with an error below two units
  of its second word. The 54 leading bits are rounded to 53 unless that error leaves the
  result open (a carry that would land on a tie, or an exact tie), and then it refuses.
  Subnormal and infinite results refuse too. 17-digit doubles (what ``repr`` and orjson print)
  take this path.

The refusals are rare and never wrong: a test compares every path against Python's ``float``.
"""

from __future__ import annotations

import math

import numba
import numpy as np

Q_MIN, Q_MAX = -342, 308  # outside: the result is 0 or infinite, or subnormal; refused


def _table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For q in [Q_MIN, Q_MAX]: (hi, lo) of T = floor(5**q * 2**s) in [2**127, 2**128), and s."""
    hi, lo, shift = [], [], []
    for q in range(Q_MIN, Q_MAX + 1):
        if q >= 0:
            p = 5**q
            s = 128 - p.bit_length()
            t = p << s if s >= 0 else p >> -s
        else:
            p = 5**-q
            s = p.bit_length() + 127
            t = (1 << s) // p
        assert 1 << 127 <= t < 1 << 128
        hi.append(t >> 64)
        lo.append(t & (2**64 - 1))
        shift.append(s)
    return np.array(hi, np.uint64), np.array(lo, np.uint64), np.array(shift, np.int64)


_HI, _LO, _SHIFT = _table()
_POW10 = np.array([10.0**k for k in range(23)])  # exact in float64 up to 1e22
_MAX_EXACT = np.uint64(1 << 53)
_M32 = np.uint64(0xFFFFFFFF)
_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
_U0, _U1, _U9, _U32, _U63 = np.uint64(0), np.uint64(1), np.uint64(9), np.uint64(32), np.uint64(63)


@numba.njit(inline="always")
def _mul128(a: np.uint64, b: np.uint64) -> tuple[np.uint64, np.uint64]:
    """The 128-bit product a * b as (high, low) words."""
    a0, a1, b0, b1 = a & _M32, a >> _U32, b & _M32, b >> _U32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _U32) + (p01 & _M32) + (p10 & _M32)
    return p11 + (p01 >> _U32) + (p10 >> _U32) + (mid >> _U32), (mid << _U32) | (p00 & _M32)


@numba.njit(inline="always")
def _clz(x: np.uint64) -> int:
    """Leading zero bits of x > 0."""
    n = 0
    for width in (32, 16, 8, 4, 2, 1):
        if x >> np.uint64(64 - width) == _U0:
            n += width
            x = x << np.uint64(width)
    return n


@numba.njit(inline="always")
def to_float(w: np.uint64, q: int, neg: bool) -> tuple[float, bool]:
    """(the float64 nearest to ``(-1 if neg else 1) * w * 10**q``, True), or (0.0, False) where
    this cannot tell it for sure (the caller then parses the text another way). The fast path is
    inlined into the caller; the rest is one call."""
    if w == _U0:
        return (-0.0 if neg else 0.0), True
    if (w <= _MAX_EXACT and -22 <= q <= 22) or q == 0:  # an integer: the conversion rounds once
        v = float(w) * _POW10[q] if q >= 0 else float(w) / _POW10[-q]
        return (-v if neg else v), True
    return _slow(w, q, neg)


@numba.njit(cache=True, nogil=True)
def _slow(w: np.uint64, q: int, neg: bool) -> tuple[float, bool]:
    while q < 0 and w % np.uint64(10) == _U0:  # 1686987391067817.0: an integer, exact below
        w = w // np.uint64(10)
        q += 1
    if w <= _MAX_EXACT and -22 <= q <= 22:
        v = float(w) * _POW10[q] if q >= 0 else float(w) / _POW10[-q]
        return (-v if neg else v), True
    if q < Q_MIN or q > Q_MAX:
        return 0.0, False
    lz = _clz(w)
    w = w << np.uint64(lz)
    k = q - Q_MIN
    hi, lo = _mul128(w, _HI[k])
    hi2, lo2 = _mul128(w, _LO[k])
    lo += hi2  # the top 128 bits of the 192-bit product, the bits below dropped
    if lo < hi2:
        hi += _U1
    upper = hi >> _U63
    below = np.uint64(9) + upper  # bits of hi under the 54 kept
    low_mask = (_U1 << below) - _U1
    m = hi >> below  # 54 bits; the exact product's bits below them are (hi & low_mask, lo) + [0, 2)
    odd = (m & _U1) == _U1
    if not odd and (hi & low_mask) == low_mask and lo >= _ONES - _U1:  # a carry would make a tie
        return 0.0, False
    if odd and (hi & low_mask) == _U0 and lo == _U0:  # an exact tie, or just above one
        return 0.0, False
    m = (m + _U1) >> _U1  # 53 bits, rounded to nearest: an odd m has a remainder above the tie
    e2 = int(below) + 1 + 128 + q - _SHIFT[k] - lz  # value = m * 2**e2
    if m == _MAX_EXACT:  # rounding carried out of 53 bits
        m = m >> _U1
        e2 += 1
    if e2 < -1074 or e2 > 971:  # subnormal or infinite
        return 0.0, False
    v = math.ldexp(float(m), e2)
    return (-v if neg else v), True
