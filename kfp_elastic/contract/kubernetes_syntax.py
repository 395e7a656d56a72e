"""Kubernetes' syntax for the values a job names before any pod exists (pure): DNS-1123 labels
(a Kueue LocalQueue, a pod's job name, a volume) and resource quantities (``500m``, ``4Gi``).

The job contract checks its settings with these (``JobSpec.validate``), and the worker pod spec's
checks (``master/pod_spec_checks.py``) the pod they become.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_RULE = (
    "a DNS-1123 label (lower-case letters, digits and '-', at most 63, starting and ending "
    "alphanumeric)"
)
_QUANTITY = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?")
_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def is_dns_label(value: str) -> bool:
    """Whether ``value`` is a DNS-1123 label (what many Kubernetes object names must be)."""
    return isinstance(value, str) and len(value) <= 63 and bool(_DNS_LABEL.fullmatch(value))


def parse_quantity(text: str | int | float) -> Decimal:
    """A Kubernetes resource quantity as a number ("1.5Gi" -> 1610612736, "250m" -> 0.25)."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
    sign, number, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if suffix and len(suffix) > 1 and suffix[0] in "eE":
        value *= Decimal(10) ** int(suffix[1:])
    elif suffix:
        value *= Decimal(_SUFFIX[suffix])
    return -value if sign == "-" else value


def format_quantity(size: int) -> str:
    """``size`` bytes as a Kubernetes quantity: whole ``Gi`` or ``Mi`` when exact, else bytes."""
    for unit, factor in (("Gi", 2**30), ("Mi", 2**20)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)
