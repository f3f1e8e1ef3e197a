"""What a run reports about its machine, for pretraining and fine-tuning alike: the device's peak
TFLOP/s (for MFU), peak memory, and MLflow's system-metrics monitor (CPU, memory, disk, network, GPU).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil
import torch

log = logging.getLogger(__name__)

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, without sparsity) for MFU, matched in this order
# against the device name: the trainer and the benchmarks read this one table. A device not in it
# gets TFLOP/s and no MFU.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 125.0,
    "V100": 125.0,
}


def peak_tflops_of(name: str) -> float | None:
    """The table's peak for a device name (`torch.cuda.get_device_name()`), or None."""
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def device_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    return peak_tflops_of(torch.cuda.get_device_name())


def memory_gib() -> dict[str, float]:
    if torch.cuda.is_available():
        return {
            "mem_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "mem_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        }
    return {"mem_rss_gib": psutil.Process().memory_info().rss / 2**30}


def start_system_metrics(run_id: str, uri: str, resume: bool = False) -> Any:
    """MLflow's own system-metrics monitor on `run_id`: CPU, memory, disk and network, and GPU
    utilisation and memory when pynvml sees a GPU, as "system/..." metrics sampled on its thread.
    Returns it (for `stop_system_metrics`), or None when MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false."""
    if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").lower() in ("false", "0", "no"):
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, resume_logging=resume, tracking_uri=uri)
    monitor.start()
    return monitor


def stop_system_metrics(monitor: Any) -> None:
    """Stop the monitor after one last sample, so a run shorter than the sampling interval has one too."""
    if monitor is None:
        return
    monitor.finish()
    try:
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as err:  # noqa: BLE001 - a missing sample must not fail the run
        log.warning("last system-metrics sample not logged (%s: %s)", type(err).__name__, err)
