"""How a request's numbers are read: one reading of a string of digits, for the routes'
parameters (api/operations.whole_number), a review item's id, admission's charge and a
declared Content-Length. Imports nothing of the service's: the settings import admission."""

from __future__ import annotations

__all__ = ["digits_value"]


def digits_value(text: str, most: int) -> int | None:
    """``text`` read as a whole number of ASCII digits, leading zeros allowed, or None when
    it is not one (int() also reads Arabic-Indic digits, " 5" and "1_0"). A value past
    ``most`` reads as ``most + 1`` without being read whole: int() raises past 4,300
    digits, even of zeros, which was a 500 where a request carried one."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return most + 1 if len(digits) > len(str(most)) else min(int(digits), most + 1)
