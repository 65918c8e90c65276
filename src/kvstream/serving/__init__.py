"""The modelled GPU and the serving loop shared by ``kvstream simulate`` and ``kvstream replay``."""

from kvstream.serving.core import (
    Arrival,
    LoadDone,
    ReleaseChunks,
    ServingConfig,
    ServingCore,
    StartLoad,
    StartStep,
    StepDone,
    WriteChunks,
)
from kvstream.serving.gpu import GPU_PROFILES, CostModel, GpuSpec, ModelShape, get_gpu, get_model_shape
from kvstream.serving.hbm import HbmCache
from kvstream.serving.metrics import RequestRecord, RunMetrics, StepRecord, summarize

__all__ = [
    "Arrival", "LoadDone", "StepDone", "StartLoad", "StartStep", "WriteChunks", "ReleaseChunks",
    "ServingConfig", "ServingCore", "CostModel", "GpuSpec", "ModelShape", "GPU_PROFILES", "get_gpu",
    "get_model_shape", "HbmCache", "RequestRecord", "RunMetrics", "StepRecord", "summarize",
]
