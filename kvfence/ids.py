"""Distinct id types so that page ids, lease ids and request ids cannot be swapped silently."""

from __future__ import annotations

from typing import NewType

PageId = NewType("PageId", int)
LeaseId = NewType("LeaseId", int)  # 64-bit, unique per pool lifetime, never reused; 0 means "no valid tag"
RequestId = NewType("RequestId", str)

NO_TAG = LeaseId(0)
