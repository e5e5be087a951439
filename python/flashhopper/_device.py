"""What flashhopper needs to know about a CUDA device, queried once per device."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class DeviceInfo(NamedTuple):
    name: str
    capability: tuple[int, int]
    num_sms: int


@functools.cache
def device_info(index: int) -> DeviceInfo:
    """Name, compute capability and SM count of ``cuda:index`` (cached: the query is not free)."""
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(p.name, (p.major, p.minor), p.multi_processor_count)
