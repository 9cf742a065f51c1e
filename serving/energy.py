"""Energy per generation from NVML (nvidia-ml-py, imported as `pynvml`).

`EnergyMeter.start()` / `.stop()` bracket a generation and return joules from the GPU's cumulative
energy counter (nvmlDeviceGetTotalEnergyConsumption, millijoules, Volta and newer). When there is no
NVIDIA GPU, or the engine runs on the CPU, the reading is `None` with a reason: never 0, which would
read as "free".
"""
from __future__ import annotations

import threading


class EnergyMeter:
    def __init__(self, device: str = "cpu") -> None:
        self._handle = None
        self.reason: str | None = None
        if not device.startswith("cuda"):
            self.reason = "engine runs on the CPU: NVML measures GPU energy only"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = int(device.split(":")[1]) if ":" in device else 0
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._nvml = pynvml
        except Exception as exc:  # no driver, no GPU, counter unsupported
            self._handle = None
            self.reason = f"NVML unavailable: {exc}"
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read_mj(self) -> int | None:
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception as exc:  # pragma: no cover - driver hiccup
            self.reason = f"NVML read failed: {exc}"
            return None

    @staticmethod
    def joules(start_mj: int | None, end_mj: int | None) -> float | None:
        if start_mj is None or end_mj is None:
            return None
        return (end_mj - start_mj) / 1000.0
