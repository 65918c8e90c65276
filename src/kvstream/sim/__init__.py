"""Discrete-event simulation: modelled tiers and GPUs driving the same policy objects as the real engine."""

from kvstream.sim.driver import Hardware, SimResult, SystemConfig, TierModel, simulate
from kvstream.sim.engine import EventLoop

__all__ = ["EventLoop", "Hardware", "SimResult", "SystemConfig", "TierModel", "simulate"]
