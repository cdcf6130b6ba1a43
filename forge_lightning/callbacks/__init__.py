"""Callbacks: throughput and MFU, text samples, video samples and predictions, Hugging Face export, validation
summaries, closed-loop evaluation, MoE router-load recording, and the progress bar, model summary, non-finite guard and config drift check
``forge`` uses by default."""

from forge_lightning.callbacks.closed_loop import ClosedLoopEval
from forge_lightning.callbacks.config_drift import ConfigDriftCheck, ResumeOptions
from forge_lightning.callbacks.exact_match import GenerationMetric
from forge_lightning.callbacks.export import HFExport
from forge_lightning.callbacks.generation import TextPredictionWriter, TextSample
from forge_lightning.callbacks.guard import NonFiniteGuard
from forge_lightning.callbacks.progress import StepProgressBar, StepTQDMProgressBar
from forge_lightning.callbacks.router_load import RouterLoadRecorder
from forge_lightning.callbacks.summary import ForgeModelSummary
from forge_lightning.callbacks.throughput import ThroughputMonitor
from forge_lightning.callbacks.validation import ValidationSummary
from forge_lightning.callbacks.video_sampling import VideoPredictionWriter, VideoSamplingCallback

__all__ = [
    "ClosedLoopEval",
    "ConfigDriftCheck",
    "ForgeModelSummary",
    "GenerationMetric",
    "HFExport",
    "NonFiniteGuard",
    "ResumeOptions",
    "RouterLoadRecorder",
    "StepProgressBar",
    "StepTQDMProgressBar",
    "TextPredictionWriter",
    "TextSample",
    "ThroughputMonitor",
    "ValidationSummary",
    "VideoPredictionWriter",
    "VideoSamplingCallback",
]
